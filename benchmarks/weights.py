"""Weight quantizations against the unquantized model: bytes and quality (deterministic), decode speed (one process).

    python benchmarks/weights.py [--model zoo:smollm2-135m] [--dtype bfloat16]
        [--variants none int8 int8-dynamic int4:g32 int4:g64] [--cache-kinds q8_0 q4_0]
        [--quality-only | --speed-only] [--engines eager compiled] [--batches 1 8] [--steps 32] [--repeats 5]

Quality (runner.infer.measure.quality, the cache gates' harness): every weight variant with the model-dtype cache, then
with each of --cache-kinds, against the unquantized model with its own-dtype cache: ΔNLL (nats/token), PPL ratio,
mean KL(full ‖ quantized), top-1 agreement, needle. Bytes are measured from the stored tensors; `× bf16` is over
the same model's bfloat16 weights (computed from its parameter count, whatever --dtype is).
Speed: per engine and batch, every variant decodes --steps greedy tokens after a --prompt-len prompt of real text
(runner's harness: warm-up, variants interleaved, order alternating); printed: median decode tokens/s, its spread,
and the median of per-repeat ratios to `none` on the same engine and batch. The compiled engine compiles each
(variant, batch) shape first and prints its seconds apart.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.compiled.engine import engine_for  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.quality import build_probe, compare, run_probe  # noqa: E402
from runner.infer.measure.timing import TokenTiming, on_device, time_interleaved  # noqa: E402
from runner.infer.quant.weights import quantize_model, weight_bytes  # noqa: E402
from runner.infer.select.speed import greedy_run  # noqa: E402

MIB = 2**20


def variants(model, names: list[str]) -> dict:
    """name → the model quantized so (a copy; `none` is the model itself)."""
    return {name: model if name == "none" else quantize_model(copy.deepcopy(model), name) for name in names}


def quality(lm, models: dict, kinds: list[str], args) -> None:
    text = load_text("pydoc")
    probe = build_probe(lm.tokenizer, text, args.prompt_len, 8, 16, 512, lm.device)
    reference = run_probe(lm.model, probe, None)
    bf16_bytes = 2 * sum(p.numel() for p in lm.model.parameters())
    print("| weights | cache | weights MiB | × bf16 | ΔNLL | PPL ratio | mean KL | top-1 | needle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, model in models.items():
        for kind in [None, *kinds]:
            if name == "none" and kind is None:
                continue
            m = compare(reference, run_probe(model, probe, kind))
            print(f"| {name} | {kind or 'model dtype'} | {weight_bytes(model) / MIB:.1f} | "
                  f"{weight_bytes(model) / bf16_bytes:.3f} | {m['delta_nll']:+.4f} | {m['ppl_ratio']:.4f} | "
                  f"{m['mean_kl']:.4f} | {m['top1_agreement']:.3f} | {m['needle_found']} |", flush=True)


def compiled_run(model, prompt: torch.Tensor, steps: int):
    """run_once(tick) of the compiled engine: a static state, prefill, `steps` compiled greedy steps."""
    engine, columns = engine_for(model), prompt.shape[1] + steps
    engine.state(None, prompt.shape[0], columns, columns)  # compiles this shape now
    live = torch.ones_like(prompt[:, 0])

    @torch.inference_mode()
    def run_once(tick):
        state = engine.state(None, prompt.shape[0], columns, columns)
        token = state.prefill(model, prompt, torch.ones_like(prompt))[0].argmax(-1)
        tick()
        for _ in range(steps - 1):
            token = state.feed(model, token, live).argmax(-1)
            tick()
    return run_once


def speed(lm, models: dict, args) -> None:
    text = load_text("pydoc")
    for engine in args.engines:
        for batch in args.batches:
            prompt = torch.tensor(token_windows(lm.tokenizer, text, args.prompt_len, batch), device=lm.device)
            runs = {}
            for name, model in models.items():
                if engine == "compiled":
                    runs[name] = compiled_run(model, prompt, args.steps)
                    stats = engine_for(model).stats
                    print(f"compile {name} b{batch}: {stats.total_s:.1f} s so far for this variant", flush=True)
                else:
                    runs[name] = greedy_run(model, prompt, args.steps - 1, None)
            marks = time_interleaved(runs, args.repeats, warmup=1, **on_device(lm.device))
            rates = {name: TokenTiming.of(m, batch).decode_tokens_per_s for name, m in marks.items()}
            per_repeat = {name: [batch * (len(r) - 1) / (r[-1] - r[0]) for r in m] for name, m in marks.items()}
            for name in models:
                ratio = statistics.median(a / b for a, b in zip(per_repeat[name], per_repeat["none"]))
                print(f"| {engine} | {batch} | {name} | {rates[name].median:.1f} | {rates[name].spread:.1f} | "
                      f"{ratio:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", nargs="+", default=["none", "int8", "int8-dynamic", "int4:g32", "int4:g64"])
    parser.add_argument("--cache-kinds", nargs="*", default=["q8_0", "q4_0"])
    parser.add_argument("--engines", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--quality-only", action="store_true")
    only.add_argument("--speed-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if "none" not in args.variants:
        args.variants.insert(0, "none")  # the baseline of every ratio
    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device="cpu" if not torch.cuda.is_available() else "cuda")
    models = variants(lm.model, args.variants)
    print(f"{args.model} {args.dtype} on {lm.device}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.speed_only:
        quality(lm, models, args.cache_kinds, args)
    if not args.quality_only:
        print("| engine | batch | weights | decode tok/s | spread | × none |")
        print("|---|---|---|---|---|---|")
        speed(lm, models, args)


if __name__ == "__main__":
    main()
