"""Speculative decoding against batch size: batched rounds vs row by row vs our target-only batched decode.

    python benchmarks/speculative.py                                   # prompt lookup on SmolLM2
    python benchmarks/speculative.py --target zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b \\
        --dtype bfloat16 --batch 1 2 4 8 --new-tokens 24
    python benchmarks/speculative.py --target zoo:qwen2.5-coder-1.5b --draft zoo:smollm2-135m --dtype bfloat16
                                                                       # another tokenizer: proposals as text

Greedy, one process. Per batch size every method runs once as warm-up, then --repeats times in alternating
order (runner.infer.measure.timing.time_interleaved); we print the median new tokens/s of each (all rows' tokens over
the wall time), its spread (max − min) and the ratio to our target-only batched decode. Methods:
    ours target-only    runner.infer.generation.generator.Generator on the left-padded batch
    ours spec batched   SpeculativeGenerator: every round drafts and verifies all live rows at once
    ours spec rows      SpeculativeGenerator(batched=False): rows one after another (the previous behaviour)
    hf generate         model.generate(do_sample=False) on the same batch (--hf)
    hf assisted         transformers' assisted generation: batch 1 only (n/a above: transformers issue #32165)
Every row of every method is checked token-identical to ours target-only ("same"; greedy speculation is exact).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compiled_vs_hf import append_row  # noqa: E402  (benchmarks/ is the script's directory)
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig  # noqa: E402
from runner.infer.config.kinds import DTYPES
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import on_device, time_interleaved  # noqa: E402
from runner.infer.speculative.generator import PROMPT_LOOKUP, SpeculativeGenerator  # noqa: E402
from runner.infer.speculative.text import same_tokenizer  # noqa: E402

LOOKUP_PROMPTS = [
    "Python lists: a = [1, 2, 3]; b = [1, 2, 3]; c = [1, 2, 3]; d = [1,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday,",
    "x = 1\ny = 2\nz = 3\nx = 1\ny = 2\n",
    "A rose is a rose is a rose is a rose. A rose is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "red green blue red green blue red green blue red",
]
CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "# Read a CSV file and print the sum of its second column\nimport csv\n\n",
    "def is_prime(n: int) -> bool:\n",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "# Sort a list of dictionaries by the key 'age'\npeople = [",
    "def binary_search(items, target):\n",
    "import json\n\n# Load config.json and print its keys\n",
    "def reverse_words(sentence: str) -> str:\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:smollm2-135m")
    parser.add_argument("--draft", default=PROMPT_LOOKUP, help="a model id, or prompt-lookup")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate() (and assisted at b1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", default="eager", choices=["eager", "compiled"],
                        help="runner's engine (compiled: speculative rows go one after another)")
    parser.add_argument("--markdown", default=None, help="append one markdown row per method to this file "
                        "(the columns of benchmarks/gpu_suite.sh's table)")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    lookup = args.draft == PROMPT_LOOKUP
    draft_lm = None if lookup else load_model(args.draft, dtype=args.dtype, device=args.device)
    draft = PROMPT_LOOKUP if lookup else draft_lm.model
    # a draft with another tokenizer proposes through text (spec_text.TextDraft): it needs both tokenizers
    text_draft = draft_lm is not None and not same_tokenizer(draft_lm.tokenizer, target.tokenizer)
    tokenizers = {"tokenizer": target.tokenizer, "draft_tokenizer": draft_lm.tokenizer} if text_draft else {}
    prompts = LOOKUP_PROMPTS if lookup else CODE_PROMPTS
    n, k = args.new_tokens, args.k
    print(f"target={args.target} draft={args.draft} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"new_tokens={n} k={k} repeats={args.repeats} load={os.getloadavg()[0]:.1f} text_draft={text_draft}")
    print(f"{'batch':>5} {'method':>18} {'tok/s':>7} {'spread':>7} {'vs ours':>8} {'accept':>7} {'rows':>11} same")
    for batch in args.batch:
        enc = target.tokenizer([prompts[i % len(prompts)] for i in range(batch)], return_tensors="pt", padding=True)
        ids, mask = enc.input_ids.to(target.device), enc.attention_mask.to(target.device)
        methods = {
            "ours target-only": lambda: Generator(target.model, GenerateConfig(
                max_new_tokens=n, temperature=0, engine=args.engine)).generate(ids, mask),
            "ours spec batched": lambda: _speculative(target.model, draft, ids, mask, n, k, True, args.engine,
                                                      **tokenizers),
            "ours spec rows": lambda: _speculative(target.model, draft, ids, mask, n, k, False, args.engine,
                                                   **tokenizers),
        }
        if args.hf:
            methods["hf generate"] = lambda: target.model.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                                   min_new_tokens=n, do_sample=False)
            if batch == 1:
                methods["hf assisted"] = lambda: target.model.generate(
                    ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    **({"prompt_lookup_num_tokens": k} if lookup else {"assistant_model": draft}))
        outputs = {}

        def timed(name):
            def run_once(tick):
                outputs[name] = methods[name]()
                tick()
            return run_once

        marks = time_interleaved({name: timed(name) for name in methods}, args.repeats, **on_device(target.device))
        reference = outputs["ours target-only"]
        base = statistics.median(_tokens(reference, ids) / m[-1] for m in marks["ours target-only"])
        hf = [_tokens(outputs["hf generate"], ids) / m[-1] for m in marks["hf generate"]] if args.hf else None
        for name, runs in marks.items():
            out = outputs[name]
            rates = [_tokens(out, ids) / m[-1] for m in runs]
            accept = f"{out.stats.acceptance_rate:7.2f}" if hasattr(out, "stats") else f"{'':>7}"
            rows = (f"{min(out.stats.row_acceptance):.2f}-{max(out.stats.row_acceptance):.2f}"
                    if hasattr(out, "stats") else "")
            width = min(out.shape[1], reference.shape[1])
            same = torch.equal(out[:, :width], reference[:, :width])
            print(f"{batch:>5} {name:>18} {statistics.median(rates):7.2f} {max(rates) - min(rates):7.2f} "
                  f"{statistics.median(rates) / base:8.2f} {accept} {rows:>11} {same}")
            if args.markdown:
                append_row(args.markdown, [
                    "speculative", f"{args.target} ← {args.draft}", args.dtype, batch, "-",
                    name if name.startswith("hf generate") else f"{name} (k={k})",
                    f"{statistics.median(rates):.1f}", f"{max(rates) - min(rates):.1f}",
                    *((f"{statistics.median(a / b for a, b in zip(rates, hf)):.3f}", "-", "-", "-",
                       torch.equal(out[:, :width], outputs["hf generate"][:, :width])) if hf else ["-"] * 5)])
        print(f"      (load average now {os.getloadavg()[0]:.1f})")


def _tokens(out: torch.Tensor, ids: torch.Tensor) -> int:
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


class _Tokens(torch.Tensor):
    """Output ids that also carry the stats of the run that made them."""


def _speculative(model, draft, ids, mask, n: int, k: int, batched: bool, engine: str, **tokenizers) -> torch.Tensor:
    gen = SpeculativeGenerator(target_model=model, draft_model=draft, batched=batched, **tokenizers,
                               config=SpeculativeConfig(max_new_tokens=n, temperature=0, spec_k=k, engine=engine))
    out = gen.generate(ids, mask).as_subclass(_Tokens)
    out.stats = gen.stats
    return out


if __name__ == "__main__":
    main()
