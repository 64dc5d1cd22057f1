"""Speculative decoding, ours vs target-only vs transformers' assisted generation: same models, prompts, dtype.

    python benchmarks/speculative.py                                   # prompt lookup on SmolLM2
    python benchmarks/speculative.py --target zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --dtype bfloat16

Greedy, batch 1 (transformers' assisted generation takes one sequence), one process. Per prompt and per k,
every method runs once as warm-up, then --repeats times in alternating order; we print the median new tokens/s
of each and the ratio to our target-only decode and to transformers' plain generate(). Methods:
    ours target-only    runner.infer.decode.Generator
    ours speculative    runner.infer.speculative.SpeculativeGenerator (spec_k = k, not adaptive)
    hf generate         model.generate(do_sample=False)
    hf assisted         model.generate(assistant_model=draft) or model.generate(prompt_lookup_num_tokens=k)
All outputs are checked token-identical to ours target-only (greedy speculative decoding is exact).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.config import DTYPES, GenerateConfig, SpeculativeConfig  # noqa: E402
from runner.infer.forward import sync  # noqa: E402
from runner.infer.generator import Generator  # noqa: E402
from runner.infer.models import load_model  # noqa: E402
from runner.infer.speculative import PROMPT_LOOKUP, SpeculativeGenerator  # noqa: E402
from runner.infer.timing import time_interleaved  # noqa: E402

LOOKUP_PROMPTS = [
    "Python lists: a = [1, 2, 3]; b = [1, 2, 3]; c = [1, 2, 3]; d = [1,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "# Read a CSV file and print the sum of its second column\nimport csv\n\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:smollm2-135m")
    parser.add_argument("--draft", default=PROMPT_LOOKUP, help="a model id, or prompt-lookup")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default="eager", choices=["eager", "compiled"],
                        help="runner's engine for ours target-only and ours speculative (compiled: in the warm-up)")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    lookup = args.draft == PROMPT_LOOKUP
    draft = PROMPT_LOOKUP if lookup else load_model(args.draft, dtype=args.dtype, device=args.device).model
    prompts = LOOKUP_PROMPTS if lookup else CODE_PROMPTS
    n = args.new_tokens
    print(f"target={args.target} draft={args.draft} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"new_tokens={n} repeats={args.repeats} engine={args.engine} device={target.device}")
    print(f"{'prompt':>6} {'k':>2} {'method':>18} {'tok/s':>7} {'vs ours':>8} {'vs hf':>6} {'accept':>7} same")
    for p_index, prompt in enumerate(prompts):
        ids = target.tokenizer(prompt, return_tensors="pt").input_ids.to(target.device)
        for k in args.k:
            methods = {
                "ours target-only": lambda: Generator(target.model, GenerateConfig(
                    max_new_tokens=n, temperature=0, engine=args.engine)).generate(ids),
                "ours speculative": lambda: _speculative(target.model, draft, ids, n, k, args.engine),
                "hf generate": lambda: target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                                             max_new_tokens=n, do_sample=False),
                "hf assisted": lambda: target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                    **({"prompt_lookup_num_tokens": k} if lookup else {"assistant_model": draft})),
            }
            outputs = {}  # the tokens of each method's last run, to compare

            def timed(name):
                def run_once(tick):
                    outputs[name] = methods[name]()
                    tick()
                return run_once

            marks = time_interleaved({name: timed(name) for name in methods}, args.repeats,
                                     sync=lambda: sync(target.device))
            reference = outputs["ours target-only"]
            speed = {name: statistics.median((outputs[name].shape[1] - ids.shape[1]) / m[-1] for m in runs)
                     for name, runs in marks.items()}
            for name in methods:
                out = outputs[name]
                accept = f"{out.acceptance:7.2f}" if hasattr(out, "acceptance") else f"{'':>7}"
                same = torch.equal(out[:, :reference.shape[1]], reference[:, :out.shape[1]])
                vs_ours = speed[name] / speed["ours target-only"]
                print(f"{p_index:>6} {k:>2} {name:>18} {speed[name]:7.1f} {vs_ours:8.2f} "
                      f"{speed[name] / speed['hf generate']:6.2f} {accept} {same}")


class _Tokens(torch.Tensor):
    """Output ids that also carry the acceptance rate of the run that made them."""


def _speculative(model, draft, ids: torch.Tensor, n: int, k: int, engine: str = "eager") -> torch.Tensor:
    gen = SpeculativeGenerator(target_model=model, draft_model=draft,
                               config=SpeculativeConfig(max_new_tokens=n, temperature=0, spec_k=k, engine=engine))
    out = gen.generate(ids).as_subclass(_Tokens)
    out.acceptance = gen.acceptance_rate
    return out


if __name__ == "__main__":
    main()
