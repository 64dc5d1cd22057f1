"""Timing harness: warm-up excluded, device synchronised before the clock is read, median of repeats.

Times our own prefill/decode chain (greedy, no stop rules, so every repeat does the same work).
Does not know about manifests, cache selection or where figures are written.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass

from typing import Callable

import torch

from runner.infer.decode import decode_one_token, forward_last, positions_for, sync
from runner.infer.kvcache import make_cache


@dataclass(frozen=True)
class DecodeTiming:
    prefill_times_s: list[float]  # one per timed repeat
    decode_times_s: list[float]
    batch: int
    steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Median over repeats of batch × steps / decode seconds."""
        return statistics.median(self.batch * self.steps / s for s in self.decode_times_s)

    @property
    def prefill_ms(self) -> float:
        return statistics.median(self.prefill_times_s) * 1000


@torch.inference_mode()
def greedy_prefill(model, prompt: torch.Tensor, kind: str | None):
    """Prefill `prompt` [B,P] into a fresh cache of `kind` → (cache, first greedy token [B], mask [B,P])."""
    cache, mask = make_cache(kind, model), torch.ones_like(prompt)
    token = forward_last(model, prompt, mask, positions_for(None, mask), cache).argmax(-1)
    return cache, token, mask


@torch.inference_mode()
def greedy_steps(model, cache, token: torch.Tensor, mask: torch.Tensor, steps: int,
                 tick: Callable[[], None] = lambda: None) -> None:
    """`steps` greedy one-token steps into `cache` (it grows; the caller's `mask` is left as it was);
    `tick()` after each token."""
    for _ in range(steps):
        positions = mask.sum(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        token = decode_one_token(model, token, mask, positions, cache).argmax(-1)
        tick()


def greedy_decode_once(model, prompt: torch.Tensor, steps: int, kind: str | None) -> tuple[float, float]:
    """Prefill `prompt` [B,P] into a fresh cache of `kind`, then `steps` greedy steps → (prefill s, decode s)."""
    start = time.perf_counter()
    cache, token, mask = greedy_prefill(model, prompt, kind)
    sync(prompt.device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    greedy_steps(model, cache, token, mask, steps)
    sync(prompt.device)
    return prefill_s, time.perf_counter() - start


def time_decode(model, prompt: torch.Tensor, steps: int, kind: str | None, repeats: int,
                warmup: int = 1) -> DecodeTiming:
    return time_decode_interleaved(model, prompt, steps, [kind], repeats, warmup)[kind]


def time_decode_interleaved(model, prompt: torch.Tensor, steps: int, kinds: list, repeats: int,
                            warmup: int = 1) -> dict:
    """Time several cache kinds round-robin (order reversed every other round), so that drift on a shared
    machine hits them alike; kind → DecodeTiming."""
    for kind in kinds:
        for _ in range(warmup):
            greedy_decode_once(model, prompt, steps, kind)
    runs: dict = {kind: [] for kind in kinds}
    for repeat in range(repeats):
        for kind in kinds if repeat % 2 == 0 else reversed(kinds):
            runs[kind].append(greedy_decode_once(model, prompt, steps, kind))
    return {kind: DecodeTiming([p for p, _ in times], [d for _, d in times], prompt.shape[0], steps)
            for kind, times in runs.items()}


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
