"""Clock hygiene for benchmarks: warm-up excluded, device synchronised before every clock read,
repeats summarised as median, p90 and spread; peak memory and the machine's copy bandwidth.

The harness takes its clock and its sync as arguments, so it is tested on a fake clock. It does not
know what is being timed: a `run_once(tick)` callable generates once and calls `tick()` whenever a
token is decided (the first tick ends the prefill).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Summary:
    """Median, 90th percentile and spread (max − min) of repeated measurements."""

    median: float
    p90: float
    spread: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
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


def time_ticks(run_once: Callable[[Callable[[], None]], None], repeats: int, warmup: int = 1,
               clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = lambda: None,
               ) -> list[list[float]]:
    """Seconds from the start of each timed repeat to each of its ticks; the `warmup` runs are not returned."""
    for _ in range(warmup):
        run_once(lambda: None)
    repeats_marks = []
    for _ in range(repeats):
        marks: list[float] = []
        sync()
        start = clock()

        def tick() -> None:
            sync()
            marks.append(clock() - start)

        run_once(tick)
        repeats_marks.append(marks)
    return repeats_marks


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
    def of(cls, repeats_marks: list[list[float]], batch: int) -> "TokenTiming":
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

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _reset_rss_peak():
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
    from runner.infer.decode import sync

    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)
