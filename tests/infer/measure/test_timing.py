"""The timing harness on a fake clock: warm-up excluded, sync before every clock read, percentiles right."""

import mmap
import random
import time

import numpy as np
import pytest
import torch

from runner.infer.measure.timing import (
    CudaEventClock,
    PeakMemory,
    Stopwatch,
    Summary,
    TokenTiming,
    on_device,
    percentile,
    time_interleaved,
    time_once,
    time_ticks,
)


class FakeDevice:
    """A clock that advances only when work is done, and a log of syncs and clock reads."""

    def __init__(self):
        self.now, self.events, self.runs = 0.0, [], 0

    def clock(self) -> float:
        self.events.append("clock")
        return self.now

    def sync(self) -> None:
        self.events.append("sync")

    def generation(self, prefill: float, step: float, tokens: int):
        def run_once(tick):
            self.runs += 1
            self.now += prefill + self.runs  # every run slower by 1 s: tells repeats apart
            tick()
            for _ in range(tokens - 1):
                self.now += step
                tick()
        return run_once


def test_warmup_runs_are_not_timed():
    device = FakeDevice()
    marks = time_ticks(device.generation(prefill=10, step=2, tokens=3), repeats=2, warmup=3,
                       clock=device.clock, sync=device.sync)
    assert device.runs == 5
    # repeat 1 is run 4 (prefill 10 + 4), repeat 2 is run 5
    assert marks == [[14, 16, 18], [15, 17, 19]]


def test_every_clock_read_follows_a_sync():
    device = FakeDevice()
    time_ticks(device.generation(prefill=1, step=1, tokens=4), repeats=3, warmup=1, clock=device.clock,
               sync=device.sync)
    reads = [i for i, e in enumerate(device.events) if e == "clock"]
    assert len(reads) == 3 * (1 + 4)  # start of each repeat + one per token; the warm-up reads nothing
    assert all(device.events[i - 1] == "sync" for i in reads)


def test_token_timing_splits_prefill_from_decode():
    marks = [[10.0, 12.0, 14.0, 16.0], [11.0, 12.0, 13.0, 20.0]]
    timing = TokenTiming.of(marks, batch=2)
    assert timing.ttft_s.median == 10.5
    assert timing.itl_s.median == 2.0 and timing.itl_s.n == 6  # gaps 2,2,2 and 1,1,7 pooled
    assert timing.decode_s.median == 7.5  # 6 and 9
    assert timing.decode_tokens_per_s.median == pytest.approx((2 * 3 / 6 + 2 * 3 / 9) / 2)
    assert timing.tokens_per_s.median == pytest.approx((8 / 16 + 8 / 20) / 2)


def test_uneven_repeats_are_refused():
    with pytest.raises(ValueError, match="same number of tokens"):
        TokenTiming.of([[1.0, 2.0], [1.0]], batch=1)


@pytest.mark.parametrize("seed", range(5))
def test_percentiles_match_numpy(seed):
    rng = random.Random(seed)
    values = [rng.uniform(0, 100) for _ in range(rng.randint(1, 40))]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    summary = Summary.of(values)
    assert summary.median == pytest.approx(np.median(values))
    assert summary.p90 == pytest.approx(np.percentile(values, 90))
    assert summary.spread == pytest.approx(max(values) - min(values))


def test_peak_memory_sees_an_allocation_inside_the_block():
    import torch

    with PeakMemory(torch.device("cpu")) as small:
        pass
    with PeakMemory(torch.device("cpu")) as big:
        # 64 MiB of fresh pages, touched: an mmap of its own, so memory the process freed earlier (and keeps
        # resident in malloc's pools after a long test session) cannot serve it without raising the RSS
        block, page = mmap.mmap(-1, 64 * 2**20), b"\1" * 2**20
        for start in range(0, 64 * 2**20, 2**20):
            block[start:start + 2**20] = page
        block.close()
    if small.scope == "block":  # Linux: the high-water mark was reset on entry
        assert big.bytes - small.bytes > 48 * 2**20
    assert big.bytes > 64 * 2**20


def test_variants_are_interleaved_with_the_order_reversed_every_other_round():
    order = []

    def variant(name):
        return lambda tick: (order.append(name), tick())

    marks = time_interleaved({"a": variant("a"), "b": variant("b"), "c": variant("c")}, repeats=3, warmup=1)
    assert order == ["a", "b", "c",  # warm-ups
                     "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert {name: len(runs) for name, runs in marks.items()} == {"a": 3, "b": 3, "c": 3}


def test_stopwatch_laps_sync_before_each_clock_read():
    device = FakeDevice()
    watch = Stopwatch(device.sync, device.clock)
    device.now += 2.5
    first = watch.lap()
    device.now += 1.0
    assert (first, watch.lap()) == (2.5, 1.0)
    assert device.events == ["sync", "clock"] * 3
    device.events.clear()
    assert time_once(lambda: setattr(device, "now", device.now + 4), device.sync, device.clock) == 4
    assert device.events == ["sync", "clock"] * 2


def test_on_device_times_cpu_work_on_the_wall_clock():
    timing = on_device(torch.device("cpu"))
    assert timing["clock"] is time.perf_counter
    seconds = time_once(lambda: time.sleep(0.05), **timing)
    assert 0.05 <= seconds < 0.5


@pytest.mark.gpu  # CUDA events: skipped without a GPU (tests/conftest.py)
def test_cuda_event_clock_measures_queued_gpu_work():
    """Events time the GPU's work, not the host's launches: a queue of products launched in microseconds measures
    as long as the wall clock that waits for it (within 20 %), and the event clock gives 0 < seconds."""
    device = torch.device("cuda")
    timing = on_device(device)
    assert isinstance(timing["clock"], CudaEventClock)
    a = torch.randn(4096, 4096, device=device)
    work = lambda: [a @ a for _ in range(50)]  # noqa: E731
    work()
    events_s = time_once(work, **timing)
    wall_s = time_once(work, sync=lambda: torch.cuda.synchronize(device))
    assert events_s > 0 and abs(events_s - wall_s) < 0.2 * wall_s
