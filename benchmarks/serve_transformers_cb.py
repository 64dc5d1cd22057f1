"""transformers' own continuous batching serving a burst (every request arriving at 0), next to our Generator
decoding the same prompts as one static batch: same model, dtype, prompts and output lengths, one process.

    python benchmarks/serve_transformers_cb.py [--model zoo:smollm2-135m] [--requests 16] [--new-tokens 32]

transformers' CB is served by runner.infer.serve.transformers_cb (its ContinuousBatchingManager, paged sdpa, the
tokens stamped as transformers samples them); ours is one `Generator.generate` of the whole batch (eager engine, the
model's dtype as cache). Both make exactly --new-tokens tokens a request (EOS off), greedy, and the tokens are
compared. Through runner's timing harness: the first run of each (warm-up: first-touch allocations, transformers'
cache set-up) is timed apart and excluded, then --repeats interleaved runs; we print medians of total output tokens/s
and of p50 TTFT (transformers' CB; for the static batch every request's first token is the batch's prefill), and the
median of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.config.decoding import GenerateConfig  # noqa: E402
from runner.infer.config.kinds import DTYPES  # noqa: E402
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.kernels.native import vector_flags  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text  # noqa: E402
from runner.infer.measure.timing import time_interleaved, time_once  # noqa: E402
from runner.infer.serve.load import Lengths, LoadSpec, build_load  # noqa: E402
from runner.infer.serve.metrics import summarize  # noqa: E402
from runner.infer.serve.requests import RequestRecord  # noqa: E402
from runner.infer.serve.transformers_cb import serve_with_transformers, transformers_cb_reason  # noqa: E402


def cpu_flags() -> str:
    """The vector extensions this CPU reports, which decide the CPU's kernels."""
    return " ".join(vector_flags()) or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    reason = transformers_cb_reason(lm.model, DTYPES[args.dtype])
    if reason:
        raise SystemExit(f"transformers' continuous batching not run: {reason}")
    spec = LoadSpec(arrival="constant", rate=1.0, num_requests=args.requests,
                    prompt_tokens=Lengths("fixed", args.prompt_tokens), output_tokens=Lengths("fixed", args.new_tokens))
    requests = [replace(r, arrival_s=0.0) for r in build_load(spec, lm.tokenizer, load_text("pydoc").text).requests]
    per_request_blocks = -(-(args.prompt_tokens + args.new_tokens) // args.block_size)
    prompts = torch.tensor([r.prompt_ids for r in requests], device=args.device)
    config = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0, eos_token_id=[])
    print(f"model={args.model} dtype={args.dtype} device={args.device} "
          f"requests={args.requests}×{args.prompt_tokens}→{args.new_tokens} "
          f"all at 0 s  threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"cpu={platform.processor() or platform.machine()} cores={os.cpu_count()} flags: {cpu_flags()}")

    served: list[list[RequestRecord]] = []
    static: list[torch.Tensor] = []

    def hf_cb(tick):
        served.append(serve_with_transformers(lm.model, requests, max_batch_size=args.requests,
                                              block_size=args.block_size,
                                              num_blocks=per_request_blocks * args.requests,
                                              max_batch_tokens=args.max_batch_tokens))
        tick()

    def ours_static(tick):
        static.append(Generator(lm.model, config).generate(prompts)[:, args.prompt_tokens:])
        tick()

    warm_s = {name: time_once(lambda: run(lambda: None)) for name, run in (("hf_cb", hf_cb),
                                                                           ("ours", ours_static))}
    marks = time_interleaved({"hf_cb": hf_cb, "ours": ours_static}, args.repeats, warmup=0)
    total = args.requests * args.new_tokens
    timed = served[1:]  # the first was the warm-up
    points = [summarize(records) for records in timed]
    cb_rates = [p["output_tokens_per_s"] for p in points]
    ours_rates = [total / m[-1] for m in marks["ours"]]
    wall_rates = [total / m[-1] for m in marks["hf_cb"]]
    by_id = [{r.id: r.output_ids for r in records} for records in timed]
    same = all(ids[r.id] == static[0][i].tolist() for ids in by_id for i, r in enumerate(requests))
    print(f"warm-up (excluded): hf_cb {warm_s['hf_cb']:.2f} s, ours static {warm_s['ours']:.2f} s")
    print(f"{'':>28} {'tok/s':>7} {'p50 TTFT ms':>12}")
    print(f"{'transformers CB (served)':>28} {statistics.median(cb_rates):>7.1f} "
          f"{statistics.median(p['p50_ttft_ms'] for p in points):>12.0f}")
    print(f"{'transformers CB (wall)':>28} {statistics.median(wall_rates):>7.1f}  (set-up and stop included)")
    print(f"{'ours, one static batch':>28} {statistics.median(ours_rates):>7.1f}")
    ratios = [o / c for o, c in zip(ours_rates, cb_rates)]
    print(f"ratio ours static / transformers CB: {statistics.median(ratios):.2f}  same tokens: {same}  "
          f"errors: {sum(p['errors'] for p in points):.0f}")


if __name__ == "__main__":
    main()
