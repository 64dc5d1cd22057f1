"""Does a random model of a real model's shapes decode at the real model's speed? One process, side by side.

    python benchmarks/shapes_vs_weights.py [--model zoo:qwen2.5-coder-0.5b] [--shape benchmarks/shapes/....json]

benchmarks/gpu_suite.sh stands random models of the Qwen pair's shapes in for the real weights where those cannot
travel (a device machine gets 64 MiB a call). That is sound only if decode speed depends on the shapes alone; this
measures it: the real model and its shape's random model, each with the compiled engine and the eager one, greedy
with EOS off (exactly --new-tokens tokens), interleaved by runner's harness. Printed: median decode tokens/s, its
spread, and the median of per-repeat ratios shape ÷ real per engine (1.0 = the same speed).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compiled_vs_hf import real_prompts  # noqa: E402  (benchmarks/ is the script's directory)
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.compiled.engine import engine_for, use_compile_cache  # noqa: E402
from runner.infer.config.decoding import GenerateConfig  # noqa: E402
from runner.infer.config.kinds import DTYPES
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import TokenTiming, on_device, time_interleaved  # noqa: E402


def decode(model, ids: torch.Tensor, new_tokens: int, engine: str):
    """run_once(tick): one greedy generation of exactly `new_tokens` tokens, a tick per token."""
    config = GenerateConfig(max_new_tokens=new_tokens, temperature=0, eos_token_id=[], engine=engine)

    @torch.inference_mode()
    def run_once(tick):
        for _ in Generator(model, config).steps(ids, torch.ones_like(ids)):
            tick()
    return run_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:qwen2.5-coder-0.5b")
    parser.add_argument("--shape", default="benchmarks/shapes/qwen2.5-coder-0.5b.json")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engines", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    use_compile_cache()
    real = load_model(args.model, dtype=args.dtype, device=args.device)
    shape = load_model(args.shape, dtype=args.dtype, device=args.device)
    ids = real.tokenizer(real_prompts(1), return_tensors="pt").input_ids.to(real.device)  # the same ids for both
    print(f"real={args.model} ({real.fingerprint['n_params']:,} parameters) shape={args.shape} "
          f"({shape.fingerprint['n_params']:,}) dtype={args.dtype} device={real.device} prompt={ids.shape[1]} "
          f"new_tokens={args.new_tokens} threads={torch.get_num_threads()} repeats={args.repeats}")
    runs = {f"{engine} {name}": decode(lm.model, ids, args.new_tokens, engine)
            for engine in args.engines for name, lm in (("real", real), ("shape", shape))}
    for name, run in runs.items():
        if name.startswith("compiled"):  # compile apart, never inside a timing
            run(lambda: None)
            print(f"compile {name}: {engine_for((real if name.endswith('real') else shape).model).stats.total_s:.1f} s",
                  flush=True)
    marks = time_interleaved(runs, args.repeats, warmup=1, **on_device(real.device))
    rates = {name: [(len(m) - 1) / (m[-1] - m[0]) for m in ms] for name, ms in marks.items()}
    print(f"{'engine model':>16} {'decode tok/s':>12} {'spread':>7} {'shape ÷ real':>12}")
    for name, ms in marks.items():
        timing = TokenTiming.of(ms, 1)
        engine = name.split()[0]
        ratio = statistics.median(a / b for a, b in zip(rates[f"{engine} shape"], rates[f"{engine} real"]))
        print(f"{name:>16} {timing.decode_tokens_per_s.median:>12.1f} {timing.decode_tokens_per_s.spread:>7.1f} "
              f"{ratio if name.endswith('shape') else 1.0:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
