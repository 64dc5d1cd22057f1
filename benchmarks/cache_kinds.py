"""Every KV-cache kind on a real model, against fp16 and the model's own cache, in one process.

    python benchmarks/cache_kinds.py [--model zoo:smollm2-135m] [--context 2048] [--speed-context 1024]

Prints, per kind:
  bytes      measured bytes of a cache holding --context tokens of real text, relative to fp16
             (targets: q8_0 ≤ 0.54, q4_0 and nf4 ≤ 0.29), and whether the estimator agrees exactly
  quality    ΔNLL of --decode-steps teacher-forced tokens decoded through the cache after a prefill
             that fills it to --context (target: q8_0 ≤ 0.01 nats), PPL ratio over --context tokens,
             mean KL(reference ‖ kind); the reference is the model's own dtype in DynamicCache
  speed      median decode tokens/s at --speed-context tokens of context, relative to fp16
Then the time of a warm auto selection (plan reused) relative to a cold one (target ≤ 0.05).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.autocache import select_cache_kind  # noqa: E402
from runner.infer.bench import time_decode  # noqa: E402
from runner.infer.config import GenerateConfig  # noqa: E402
from runner.infer.data import load_text, token_windows  # noqa: E402
from runner.infer.kvcache import cache_bytes, estimate_cache_bytes, make_cache  # noqa: E402
from runner.infer.models import load_model  # noqa: E402
from runner.infer.quality import build_probe, compare, run_probe  # noqa: E402

KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"]


def measured_bytes(model, ids: torch.Tensor, kind: str) -> int:
    cache = make_cache(kind, model)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--speed-context", type=int, default=1024)
    parser.add_argument("--speed-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    model, text = lm.model, load_text("pydoc")
    print(f"model={args.model} dtype={args.dtype} device={lm.device} threads={torch.get_num_threads()} "
          f"context={args.context} speed_context={args.speed_context} repeats={args.repeats}")

    ids = torch.tensor(token_windows(lm.tokenizer, text, args.context, 1), device=lm.device)
    sizes = {kind: measured_bytes(model, ids, kind) for kind in KINDS}
    agree = {kind: sizes[kind] == estimate_cache_bytes(model.config, kind, 1, args.context, model.dtype)
             for kind in KINDS}

    probe = build_probe(lm.tokenizer, text, prompt_len=args.context - args.decode_steps - 1,
                        decode_steps=args.decode_steps, windows=2, ppl_len=args.context, device=lm.device)
    reference = run_probe(model, probe, None)
    quality = {kind: compare(reference, run_probe(model, probe, kind)) for kind in KINDS}

    prompt = torch.tensor(token_windows(lm.tokenizer, text, args.speed_context, 1), device=lm.device)
    speed: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for repeat in range(args.repeats):  # interleaved so drift on a shared machine hits every kind alike
        for kind in KINDS if repeat % 2 == 0 else reversed(KINDS):
            timing = time_decode(model, prompt, args.speed_steps, kind, repeats=1, warmup=1 if repeat == 0 else 0)
            speed[kind].append(timing.decode_tokens_per_s)
    fp16_speed = statistics.median(speed["fp16"])

    print(f"\n{'kind':>5} {'MiB':>7} {'vs fp16':>8} {'est=meas':>8} {'ΔNLL':>9} {'PPL ratio':>9} {'mean KL':>9} "
          f"{'needle':>6} {'tok/s':>7} {'vs fp16':>8}")
    for kind in KINDS:
        q, tps = quality[kind], statistics.median(speed[kind])
        print(f"{kind:>5} {sizes[kind] / 2**20:7.2f} {sizes[kind] / sizes['fp16']:8.3f} {str(agree[kind]):>8} "
              f"{q['delta_nll']:9.5f} {q['ppl_ratio']:9.4f} {q['mean_kl']:9.5f} {str(q['needle_found']):>6} "
              f"{tps:7.1f} {tps / fp16_speed:8.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        config = GenerateConfig(cache_kind="auto", cache_plan_path=os.path.join(tmp, "plans.json"))
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            chosen = select_cache_kind(model, lm.tokenizer, config, batch_size=1, identity=lm.fingerprint)
            timings.append(time.perf_counter() - start)
    print(f"\nauto selection (default settings): cold {timings[0]:.2f} s → {chosen.kind}; warm (plan reused) "
          f"{timings[1] * 1000:.1f} ms; warm / cold = {timings[1] / timings[0]:.4f}")


if __name__ == "__main__":
    main()
