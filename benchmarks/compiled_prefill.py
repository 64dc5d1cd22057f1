"""Time to the first token with the compiled engine's prefill eager or compiled, against the eager engine: one
process.

    python benchmarks/compiled_prefill.py [--model zoo:smollm2-135m] [--prompt-lens 100 500 2000] [--batch 1]

Variants, per prompt length (prompts cut from real text, the same for all), timed by runner's harness (warm-up,
interleaved, order alternating, device synced), one tick when the first new token is decided:
    eager             the eager engine (growing cache, eager prefill)
    compiled          engine: compiled, prefill: eager (the static forward run eagerly)
    compiled-prefill  engine: compiled, prefill: compiled (pieces of 512 columns, the last padded to a power of two)
Compile seconds of each compiled variant are printed on their own lines before any timing. Per variant: median
seconds to the first token, spread, and the median of per-repeat ratios eager / variant (> 1 = faster than eager);
`same` says whether its first tokens equal the eager engine's.
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compiled_kinds import model_parser  # noqa: E402  (benchmarks/ is the script's directory)
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.compiled.engine import engine_for
from runner.infer.compiled.state import PREFILL_MAX  # noqa: E402
from runner.infer.config.decoding import GenerateConfig  # noqa: E402
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.timing import on_device, time_interleaved  # noqa: E402

VARIANTS = {"eager": ("eager", "eager"), "compiled": ("compiled", "eager"),
            "compiled-prefill": ("compiled", "compiled")}


def first_token(model, ids: torch.Tensor, engine: str, prefill: str, outs: dict, name: str):
    """run_once(tick): a new Generator prefills `ids` [B,P] and decides the first token (one tick)."""
    config = GenerateConfig(max_new_tokens=1, temperature=0, eos_token_id=[], engine=engine, prefill=prefill,
                            max_seq_len=max(2048, ids.shape[1] + PREFILL_MAX + 2))  # both: one cache length

    @torch.inference_mode()
    def run_once(tick):
        for token in Generator(model, config).steps(ids):
            tick()
            outs[name] = token
    return run_once


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[100, 500, 2000])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    text = load_text("pydoc", None)
    print(f"model={args.model} dtype={args.dtype} device={lm.device} batch={args.batch} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__}", flush=True)
    engine = engine_for(lm.model)
    for length in args.prompt_lens:
        ids = torch.tensor(token_windows(lm.tokenizer, text, length, args.batch), device=lm.device)  # [B,P]
        outs: dict[str, torch.Tensor] = {}
        runs = {name: first_token(lm.model, ids, *how, outs, name) for name, how in VARIANTS.items()}
        for name, (kind, _) in VARIANTS.items():  # compile now, outside any timing
            if kind == "compiled":
                before = engine.stats.total_s
                runs[name](lambda: None)
                print(f"compile {name} at {length} tokens: {engine.stats.total_s - before:.1f} s", flush=True)
        marks = time_interleaved(runs, args.repeats, warmup=1, **on_device(lm.device))
        seconds = {name: [m[0] for m in ms] for name, ms in marks.items()}
        print(f"prompt {length}: {'variant':>16} {'first token s':>13} {'spread':>7} {'eager ÷':>8} same")
        for name, values in seconds.items():
            ratio = statistics.median(e / v for e, v in zip(seconds["eager"], values))
            same = torch.equal(outs[name], outs["eager"])
            print(f"{'':>12}{name:>16} {statistics.median(values):>13.3f} {max(values) - min(values):>7.3f} "
                  f"{ratio:>8.2f} {'yes' if same else 'NO'}", flush=True)
    print(f"compiled engine: {engine.stats.compiles} graphs, {engine.stats.recompiles} recompiles, "
          f"{engine.stats.total_s:.0f} s compiling in all")


if __name__ == "__main__":
    main()
