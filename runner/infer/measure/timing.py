"""The one timing harness: warm-up excluded, device synchronised before every clock read, variants
interleaved, repeats summarised as median, p90 and spread; peak memory and the machine's copy bandwidth.
On CUDA the clock is CUDA events on the device's own timeline (`on_device`); elsewhere time.perf_counter.

Every figure runner reports goes through `time_interleaved` (bench cells, the cache selector's speed pick,
the steps' wall clocks, benchmarks/*.py). The harness takes its clock and its sync as arguments, so it is
tested on a fake clock. It does not know what is being timed: a `run_once(tick)` callable generates once
and calls `tick()` whenever a token is decided (the first tick ends the prefill).
"""

from __future__ import annotations

import math
import platform
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.infer.decode.forward import sync
from runner.infer.kernels import heap


@dataclass(frozen=True)
class Summary:
    """Median, 90th percentile and spread (max − min) of repeated measurements."""

    median: float
    p90: float
    spread: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(values), percentile(values, 90), max(values) - min(values), len(values))


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): percentile([1, 2, 3, 4], 90) = 3.7."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


Tick = Callable[[], None]


def on_device(device: torch.device) -> dict:
    """The harness's `sync` and `clock` for a device: `time_interleaved(..., **on_device(device))`. On CUDA the
    clock reads CUDA events (`CudaEventClock`); elsewhere the wall clock, after the device's sync."""
    clock = CudaEventClock(device) if device.type == "cuda" else time.perf_counter
    return {"sync": lambda: sync(device), "clock": clock}


class CudaEventClock:
    """Seconds on the GPU's timeline since this clock was made: each reading records an event on the device's
    current stream and waits for it, so a difference of two readings is what CUDA events measure between them
    (the elapsed time of queued GPU work, not of the host's launches). Made per timing: float32 milliseconds
    keep microseconds over spans of minutes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.origin = self._record()

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def __call__(self) -> float:
        event = self._record()
        event.synchronize()
        return self.origin.elapsed_time(event) / 1e3


def time_interleaved(variants: dict[str, Callable[[Tick], None]], repeats: int, warmup: int = 1,
                     clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = lambda: None,
                     ) -> dict[str, list[list[float]]]:
    """The one timing harness. Each variant's `run_once(tick)` does its work once and calls `tick()` whenever a
    token is decided. Every variant is warmed up `warmup` times (not timed), then the variants run round-robin,
    the order reversed every other round, so drift on a shared machine hits them alike; the device is synced
    before every clock read. → name → per timed repeat, the seconds from its start to each of its ticks."""
    for run_once in variants.values():
        for _ in range(warmup):
            run_once(lambda: None)
    marks: dict[str, list[list[float]]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            marks[name].append(_timed(variants[name], clock, sync))
    return marks


def _timed(run_once: Callable[[Tick], None], clock: Callable[[], float], sync: Callable[[], None]) -> list[float]:
    ticks: list[float] = []
    sync()
    start = clock()

    def tick() -> None:
        sync()
        ticks.append(clock() - start)

    run_once(tick)
    return ticks


def time_ticks(run_once: Callable[[Tick], None], repeats: int, warmup: int = 1,
               clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = lambda: None,
               ) -> list[list[float]]:
    """One variant through `time_interleaved`: seconds from the start of each timed repeat to each of its ticks."""
    return time_interleaved({"": run_once}, repeats, warmup, clock, sync)[""]


def time_once(run_once: Callable[[], object], sync: Callable[[], None] = lambda: None,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one call of `run_once` takes (no warm-up: a step's own wall clock), synced before both clock reads."""
    watch = Stopwatch(sync, clock)
    run_once()
    return watch.lap()


class Stopwatch:
    """Seconds between laps, the device synced before every clock read: for a loop that times its own phases (a
    streaming generator's prefill and decode), which cannot hand its body to `time_interleaved`."""

    def __init__(self, sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter):
        self.sync, self.clock = sync, clock
        sync()
        self.last = clock()

    def lap(self) -> float:
        """Seconds since the start or the last lap."""
        self.sync()
        now = self.clock()
        seconds, self.last = now - self.last, now
        return seconds


@dataclass(frozen=True)
class TokenTiming:
    """What a generation's ticks say: time to first token (the prefill), inter-token latency, tokens/s."""

    ttft_s: Summary  # per repeat
    itl_s: Summary  # every gap between consecutive tokens, pooled over repeats
    decode_s: Summary  # first token → last token, per repeat
    decode_tokens_per_s: Summary  # batch × (tokens − 1) / decode_s, per repeat
    tokens_per_s: Summary  # batch × tokens / whole time, per repeat
    tokens: int

    @classmethod
    def of(cls, repeats_marks: list[list[float]], batch: int) -> TokenTiming:
        tokens = len(repeats_marks[0]) if repeats_marks else 0
        if any(len(m) != tokens for m in repeats_marks) or tokens == 0:
            counts = [len(m) for m in repeats_marks]
            raise ValueError(f"every repeat must tick the same number of tokens (got {counts})")
        gaps = [b - a for m in repeats_marks for a, b in zip(m, m[1:])]
        decode = [m[-1] - m[0] for m in repeats_marks]
        return cls(
            ttft_s=Summary.of([m[0] for m in repeats_marks]),
            itl_s=Summary.of(gaps),
            decode_s=Summary.of(decode),
            decode_tokens_per_s=Summary.of([batch * (tokens - 1) / d for d in decode if d > 0]),
            tokens_per_s=Summary.of([batch * tokens / m[-1] for m in repeats_marks if m[-1] > 0]),
            tokens=tokens,
        )


class PeakMemory:
    """Peak memory while the block runs: the CUDA allocator's peak, or on CPU the process's peak RSS.

    On Linux the RSS high-water mark is reset on entry (/proc/self/clear_refs), so the figure belongs to the
    block; elsewhere it is the process's lifetime peak, and `scope` says so.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0
        self.scope = "allocator" if device.type == "cuda" else "process"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            heap.release()  # what earlier blocks freed and the heap kept is not this block's
            if _reset_rss_peak():
                self.scope = "block"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.bytes = _rss_peak_bytes()


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> int:
    try:
        for line in open("/proc/self/status", encoding="utf-8"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large on-device copy (read + write counted), median of `repeats` after a warm-up:
    the memory bandwidth a decode step can at best use."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return _bytes_per_s(lambda: dst.copy_(src), 2 * src.numel() * 4, device, repeats)


def read_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of reading a large on-device buffer once (a sum over it, with torch's threads), median of
    `repeats` after a warm-up: what a decode step that streams its weights can at best reach, measured as the step
    reads (copy_bandwidth also writes)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    return _bytes_per_s(src.sum, src.numel() * 4, device, repeats)


def _bytes_per_s(run: Callable[[], object], moved: int, device: torch.device, repeats: int) -> float:
    """`moved` bytes over the median time of `run`, timed by the harness after a warm-up."""
    def once(tick: Tick) -> None:
        run()
        tick()

    marks = time_ticks(once, repeats, warmup=1, **on_device(device))
    return moved / statistics.median(m[-1] for m in marks)


def device_name(device: torch.device) -> str:
    """What a timing was taken on: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
