"""Our decode loop vs transformers' `model.generate()`: same model, prompts, dtype and cache, one process.

    python benchmarks/decode_vs_hf.py [--model zoo:smollm2-135m] [--dtype float32] [--batch-sizes 1 8]

Both run through runner's timing harness (one warm-up each, interleaved, order alternating, device synced);
we print the median tokens/s of each and the median of the per-repeat ratios (ours / hf). Greedy, EOS off so
both make exactly --new-tokens tokens; the tokens are checked identical.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compiled_vs_hf import real_prompts  # noqa: E402  (benchmarks/ is the script's directory)
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.cache.registry import make_cache  # noqa: E402
from runner.infer.config.decoding import GenerateConfig  # noqa: E402
from runner.infer.config.kinds import DTYPES, KIND_NAMES
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import on_device, time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cache-kind", default=None, choices=KIND_NAMES)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    config = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0, eos_token_id=[], cache_kind=args.cache_kind)
    print(f"model={args.model} dtype={args.dtype} device={lm.device} cache={args.cache_kind or 'model dtype'} "
          f"new_tokens={args.new_tokens} threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}  same tokens")
    for batch in args.batch_sizes:
        enc = lm.tokenizer(real_prompts(batch), return_tensors="pt", padding=True).to(lm.device)

        outs: dict[str, list[torch.Tensor]] = {"ours": [], "hf": []}

        def ours(tick):
            outs["ours"].append(Generator(lm.model, config).generate(enc.input_ids, enc.attention_mask))
            tick()

        def hf(tick):
            outs["hf"].append(lm.model.generate(**enc, max_new_tokens=args.new_tokens, do_sample=False,
                                                eos_token_id=None,
                                                cache=make_cache(args.cache_kind, lm.model)))
            tick()

        marks = time_interleaved({"ours": ours, "hf": hf}, args.repeats, **on_device(lm.device))
        rates = {name: [batch * args.new_tokens / m[-1] for m in runs] for name, runs in marks.items()}
        same = all(torch.equal(a, b) for a, b in zip(outs["ours"], outs["hf"]))
        ratios = [o / h for o, h in zip(rates["ours"], rates["hf"])]
        print(f"{batch:>5} {statistics.median(rates['ours']):>11.1f} {statistics.median(rates['hf']):>9.1f} "
              f"{statistics.median(ratios):>6.3f}  {same}", flush=True)


if __name__ == "__main__":
    main()
