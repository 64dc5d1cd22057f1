"""What eviction costs and saves at a long context: prefill and decode seconds, peak memory and cache bytes of each
cache kind (plain, quantized, evicting, stacked) against the model's own cache, in one process.

    python benchmarks/eviction_speed.py --model zoo:smollm2-135m --context 2048 --kinds fp32 fp32+snapkv:0.5
    python benchmarks/eviction_speed.py --model benchmarks/shapes/qwen2.5-coder-0.5b.json --device cuda \\
        --dtype bfloat16 --context 8192 32768 --kinds bf16 bf16+snapkv:0.5 bf16+knorm:0.75 q8_0+snapkv:0.75

Per context and kind, batch 1, eager engine: a fresh cache, a prefill of --context random tokens (speed does not
depend on which: a model of a shape from benchmarks/shapes/ does as well as its weights), then --decode greedy
steps. The kinds run interleaved through runner's timing harness (one warm-up each, order reversed every other
repeat); medians and spreads (max − min) of prefill seconds and decode tokens/s, each as a ratio to the first kind.
An evicting kind's prompt goes in one forward (eviction acts on each prompt forward), so every kind prefills whole.
Peak memory (CUDA: allocator peak; CPU: peak RSS of the process since the block began) and the cache's measured
bytes after the decode come from one more, untimed run per kind.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.cache.layers import cache_bytes  # noqa: E402
from runner.infer.cache.registry import make_cache  # noqa: E402
from runner.infer.decode.forward import DecodeState  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import PeakMemory, on_device, time_interleaved  # noqa: E402

MIB = 2**20


def decode_once(model, kind: str, prompt: torch.Tensor, steps: int, tick=lambda: None) -> DecodeState:
    """Prefill `prompt` [1,T] into a fresh cache of `kind`, tick, then `steps` greedy tokens, tick."""
    state = DecodeState(make_cache(kind, model))
    with torch.inference_mode():
        token = state.prefill(model, prompt, torch.ones_like(prompt))[0].argmax(-1)
        tick()
        live = torch.ones(1, dtype=torch.long, device=prompt.device)
        for _ in range(steps):
            token = state.feed(model, token, live).argmax(-1)
        tick()
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context", type=int, nargs="+", default=[2048])
    parser.add_argument("--kinds", nargs="+", default=["fp32", "fp32+snapkv:0.5", "q8_0+snapkv:0.75"],
                        help="the first is the baseline of every ratio")
    parser.add_argument("--decode", type=int, default=32, help="greedy steps after the prefill")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    model, device = lm.model, torch.device(args.device)
    print(f"model={args.model} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} "
          f"decode={args.decode} repeats={args.repeats}")
    print(f"{'context':>7} {'kind':>22} {'prefill s':>9} {'spread':>7} {'÷base':>6} {'decode tok/s':>12} "
          f"{'spread':>7} {'÷base':>6} {'peak MiB':>9} {'cache MiB':>9} {'÷base':>6}")
    generator = torch.Generator().manual_seed(0)
    for context in args.context:
        prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(device)
        variants = {kind: (lambda tick, kind=kind: decode_once(model, kind, prompt, args.decode, tick))
                    for kind in args.kinds}
        marks = time_interleaved(variants, args.repeats, **on_device(device))
        rows = {}
        for kind in args.kinds:
            prefill = [m[0] for m in marks[kind]]
            rate = [args.decode / (m[1] - m[0]) for m in marks[kind]]
            with PeakMemory(device) as peak:
                state = decode_once(model, kind, prompt, args.decode)
            rows[kind] = (statistics.median(prefill), max(prefill) - min(prefill), statistics.median(rate),
                          max(rate) - min(rate), peak.bytes / MIB, cache_bytes(state.cache) / MIB)
            del state
        base = rows[args.kinds[0]]
        for kind, (p, ps, r, rs, peak_mib, cache_mib) in rows.items():
            print(f"{context:>7} {kind:>22} {p:9.3f} {ps:7.3f} {p / base[0]:6.2f} {r:12.1f} {rs:7.1f} "
                  f"{r / base[2]:6.2f} {peak_mib:9.0f} {cache_mib:9.1f} {cache_mib / base[5]:6.3f}")


if __name__ == "__main__":
    main()
