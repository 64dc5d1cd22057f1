"""Decode speed of every cache kind at a long context, compiled engine vs eager, against fp16: one process.

    python benchmarks/compiled_kinds.py [--context 4096] [--kinds fp16 q8_0 q4_0 q4_1 nf4 kivi4 kivi2]
        [--engines compiled eager]

Each (engine, kind) prefills the same --context tokens of real text once (untimed), then every timed repeat rolls
its cache back to the prompt and decodes --steps greedy tokens from it (runner's harness: warm-up, variants
interleaved, order alternating), so only decode steps at that context are timed. Printed per variant: median
decode tokens/s, its spread, and the median of per-repeat ratios to fp16 on the same engine. The compiled
engine's cache is sized to exactly context + steps columns (no bucket rounding), and its compile seconds are
printed on their own lines before any timing.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compiled_vs_hf import append_row  # noqa: E402  (benchmarks/ is the script's directory)
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.cache.registry import make_cache  # noqa: E402
from runner.infer.compiled.engine import engine_for  # noqa: E402
from runner.infer.config.kinds import DTYPES  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.timing import TokenTiming, on_device, time_interleaved  # noqa: E402
from runner.infer.speculative.generator import crop_to, feed  # noqa: E402


def prefilled(model, engine: str, kind: str, prompt: torch.Tensor, steps: int):
    """A cache of `kind` holding prompt[:-1] ([P] tokens), for `engine`; the compiled one compiled now."""
    columns = prompt.numel() + steps
    if engine == "compiled":
        cache = engine_for(model).state(kind, 1, columns, columns)
        print(f"compile {kind}: {engine_for(model).stats.compile_s[(kind, 1, columns, 1)]:.1f} s", flush=True)
        cache.prefill(model, prompt[None, :-1], torch.ones_like(prompt[None, :-1]), q_chunk=512)
    else:
        cache = make_cache(kind, model)
        for start in range(0, prompt.numel() - 1, 512):
            feed(model, cache, prompt[start:min(start + 512, prompt.numel() - 1)])
    return cache


def decode_from(model, cache, prompt: torch.Tensor, steps: int):
    """run_once(tick): roll the cache back to the prompt, then `steps` greedy one-token steps (a tick each)."""
    @torch.inference_mode()
    def run_once(tick):
        crop_to(cache, prompt.numel() - 1)
        token = prompt[-1:].clone()  # made in inference mode like every later token: one guard, no recompile
        for _ in range(steps):
            token = feed(model, cache, token).argmax(-1)
            tick()
    return run_once


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the model arguments every single-model benchmark takes: --model, --dtype, --device."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")
    return parser


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=["fp16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4", "kivi2"])
    parser.add_argument("--engines", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    parser.add_argument("--markdown", default=None, help="append one row per variant to this markdown file")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    text = load_text("pydoc", None)
    prompt = torch.tensor(token_windows(lm.tokenizer, text, args.context, 1)[0], device=lm.device)
    print(f"model={args.model} dtype={args.dtype} device={lm.device} context={args.context} steps={args.steps} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__}", flush=True)
    with torch.inference_mode():
        caches = {(e, k): prefilled(lm.model, e, k, prompt, args.steps) for e in args.engines for k in args.kinds}
    runs = {f"{e} {k}": decode_from(lm.model, cache, prompt, args.steps) for (e, k), cache in caches.items()}
    marks = time_interleaved(runs, args.repeats, warmup=1, **on_device(lm.device))
    rates = {name: [(len(m) - 1) / (m[-1] - m[0]) for m in ms] for name, ms in marks.items()}
    print(f"{'engine kind':>16} {'decode tok/s':>12} {'spread':>7} {'÷ fp16':>7}  (same engine)")
    for name, ms in marks.items():
        timing = TokenTiming.of(ms, 1)
        reference = f"{name.split()[0]} fp16"
        ratio = (statistics.median(a / b for a, b in zip(rates[name], rates[reference])) if reference in rates
                 else float("nan"))
        print(f"{name:>16} {timing.decode_tokens_per_s.median:>12.1f} {timing.decode_tokens_per_s.spread:>7.1f} "
              f"{ratio:>7.3f}", flush=True)
        if args.markdown:
            append_row(args.markdown, ["cache kinds", args.model, args.dtype, 1, args.context, name,
                                       f"{timing.decode_tokens_per_s.median:.1f}",
                                       f"{timing.decode_tokens_per_s.spread:.1f}", "-", "-", f"{ratio:.3f}", "-", "-"])
    for engine in args.engines:
        if engine == "compiled":
            stats = engine_for(lm.model).stats
            print(f"compiled engine: {stats.compiles} graphs, {stats.recompiles} recompiles, "
                  f"{stats.total_s:.0f} s compiling in all")


if __name__ == "__main__":
    main()
