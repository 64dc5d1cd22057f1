"""Decode speed of our forward chain per cache kind: greedy prefill + one-token steps, timed by the harness.

Greedy with no stop rules, so every repeat of every kind does the same work. On `engine: compiled` the same steps
run on the compiled engine's static states (compiled.py); its steps are compiled by `compile_pairs` before any
timing, and what that took is returned apart, never inside a timing. Used by the cache selector's speed pick, bench
cells (measure_ours) and benchmarks/*.py. Does not know about manifests, selection or where figures are written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.infer.cache.registry import make_cache
from runner.infer.compiled.engine import CompiledEngine, engine_for
from runner.infer.decode.forward import decode_one_token, forward_last, positions_for
from runner.infer.decode.sampling import greedy_tokens
from runner.infer.measure.timing import TokenTiming, on_device, time_interleaved


@torch.inference_mode()
def greedy_prefill(model, prompt: torch.Tensor, kind: str | None):
    """Prefill `prompt` [B,P] into a fresh cache of `kind` → (cache, first greedy token [B], mask [B,P])."""
    cache, mask = make_cache(kind, model), torch.ones_like(prompt)
    token = greedy_tokens(forward_last(model, prompt, mask, positions_for(None, mask), cache))
    return cache, token, mask


@torch.inference_mode()
def greedy_steps(model, cache, token: torch.Tensor, mask: torch.Tensor, steps: int,
                 tick: Callable[[], None] = lambda: None) -> None:
    """`steps` greedy one-token steps into `cache` (it grows; the caller's `mask` is left as it was);
    `tick()` after each token."""
    for _ in range(steps):
        positions = mask.sum(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        token = greedy_tokens(decode_one_token(model, token, mask, positions, cache))
        tick()


def greedy_run(model, prompt: torch.Tensor, steps: int, kind: str | None) -> Callable[[Callable[[], None]], None]:
    """A `run_once(tick)` for the harness: prefill `prompt` [B,P] (tick), then `steps` greedy steps (a tick each)."""
    def run_once(tick: Callable[[], None]) -> None:
        cache, token, mask = greedy_prefill(model, prompt, kind)
        tick()
        greedy_steps(model, cache, token, mask, steps, tick)

    return run_once


def compiled_run(model, prompt: torch.Tensor, steps: int, kind: str | None, max_seq_len: int,
                 engine: CompiledEngine | None = None) -> Callable[[Callable[[], None]], None]:
    """greedy_run on the compiled engine: a fresh static state of `kind` per run (its step compiled beforehand by
    `compile_pairs`; the state's cache is the engine's, reused, so nothing is allocated while it is kept)."""
    engine = engine or engine_for(model)  # another engine of the same model: benchmarks comparing two

    @torch.inference_mode()
    def run_once(tick: Callable[[], None]) -> None:
        state = engine.state(kind, prompt.shape[0], prompt.shape[1] + steps, max_seq_len)
        logits, _ = state.prefill(model, prompt, torch.ones_like(prompt))
        token, live = greedy_tokens(logits), torch.ones(prompt.shape[0], dtype=torch.long, device=prompt.device)
        tick()
        for _ in range(steps):
            token = greedy_tokens(state.feed(model, token, live))
            tick()

    return run_once


def compile_pairs(pairs: dict[str, tuple], prompt: torch.Tensor, steps: int, max_seq_len: int,
                  engine: CompiledEngine | None = None) -> dict[str, float]:
    """Compile (or load from inductor's cache) the compiled engine's decode step for each (model, cache kind) at
    the shape `compiled_run` uses → name → seconds it took (0 when already compiled). Call before timing.
    `engine`: as compiled_run's."""
    seconds = {}
    for name, (model, kind) in pairs.items():
        engine = engine or engine_for(model)
        before = engine.stats.total_s
        engine.state(kind, prompt.shape[0], prompt.shape[1] + steps, max_seq_len)
        seconds[name] = engine.stats.total_s - before
    return seconds


def time_decode_kinds(model, prompt: torch.Tensor, steps: int, kinds: list, repeats: int,
                      warmup: int = 1, engine: str = "eager", max_seq_len: int | None = None) -> dict:
    """Time several cache kinds interleaved → kind → TokenTiming (ttft = prefill; decode = the `steps` steps)."""
    return time_decode_pairs({kind: (model, kind) for kind in kinds}, prompt, steps, repeats, warmup, engine,
                             max_seq_len)


def time_decode_pairs(pairs: dict[str, tuple], prompt: torch.Tensor, steps: int, repeats: int,
                      warmup: int = 1, engine: str = "eager", max_seq_len: int | None = None) -> dict:
    """Time (model, cache kind) pairs interleaved (a model per weight quantization) on `engine` → name →
    TokenTiming. Compiled: the steps must have been compiled first (`compile_pairs`), or the warm-up compiles them
    (untimed, but unreported)."""
    columns = max_seq_len or prompt.shape[1] + steps
    runs = {name: compiled_run(model, prompt, steps, kind, columns) if engine == "compiled"
            else greedy_run(model, prompt, steps, kind) for name, (model, kind) in pairs.items()}
    marks = time_interleaved(runs, repeats, warmup, **on_device(prompt.device))
    return {name: TokenTiming.of(marks[name], prompt.shape[0]) for name in pairs}
