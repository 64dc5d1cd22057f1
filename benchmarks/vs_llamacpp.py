"""Our engines against llama.cpp, and llama.cpp through runner against llama-bench, in one process.

    python benchmarks/vs_llamacpp.py [--model zoo:smollm2-135m] [--kinds fp16 q8_0 q4_0] [--threads 2]

Engines eager, compiled and llama.cpp × KV kinds, batch 1, greedy, EOS ignored: every variant timed by the one
harness, interleaved (one warm-up each, order alternating), tokens/s of the decode (prefill left out) as medians and
spreads, then every ratio. Then llama-bench (built from the sdist's vendored llama.cpp, cached) on the same GGUF,
tg<new tokens>, the same threads and K/V types (-ctk/-ctv, flash attention as runner sets it): runner's llama.cpp
over llama-bench is the overhead of the Python binding and our loop (target: within 10 %).

Weights differ between the sides: ours are the zoo GGUF dequantized to float32 (transformers), llama.cpp runs the
GGUF as it is (SmolLM2: Q4_1). The table says tokens/s per side; it is not a comparison of equal arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.config.llamacpp import GGML_NAMES, LlamaCppOptions, flash_attention  # noqa: E402
from runner.infer.llamacpp.engine import LlamaCppEngine  # noqa: E402
from runner.infer.llamacpp.gguf_file import model_gguf  # noqa: E402
from runner.infer.llamacpp.install import llama_bench  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.timing import TokenTiming, time_interleaved  # noqa: E402
from runner.infer.select.speed import compile_pairs, compiled_run, greedy_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--kinds", nargs="+", default=["fp16", "q8_0", "q4_0"])
    parser.add_argument("--engines", nargs="+", default=["eager", "compiled", "llama.cpp"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="float32", device="cpu")
    gguf = model_gguf(args.model, lm.model, lm.tokenizer)
    prompt = token_windows(lm.tokenizer, load_text("pydoc"), args.prompt_len, 1)
    ids = torch.tensor(prompt)
    steps = args.new_tokens - 1  # ours tick after the prefill and after each step: new_tokens ticks in all
    options = LlamaCppOptions(threads=args.threads)
    runs, engines = {}, {}
    for kind in args.kinds:
        if "eager" in args.engines:
            runs[f"eager {kind}"] = greedy_run(lm.model, ids, steps, kind)
        if "compiled" in args.engines:
            runs[f"compiled {kind}"] = compiled_run(lm.model, ids, steps, kind, ids.shape[1] + steps)
        if "llama.cpp" in args.engines:
            engines[kind] = LlamaCppEngine(gguf, kind=kind, n_ctx=args.prompt_len + args.new_tokens + 8,
                                           options=options)
            runs[f"llama.cpp {kind}"] = engines[kind].timed_greedy(prompt[0], args.new_tokens)
    if "compiled" in args.engines:
        seconds = compile_pairs({k: (lm.model, k) for k in args.kinds}, ids, steps, ids.shape[1] + steps)
        print("compiled engine, compile seconds (apart from the timing):",
              ", ".join(f"{k} {s:.0f}" for k, s in seconds.items()))
    print(f"model={args.model} gguf={gguf.name} threads={args.threads} prompt={args.prompt_len} "
          f"new_tokens={args.new_tokens} repeats={args.repeats}")
    marks = time_interleaved(runs, args.repeats)
    timing = {name: TokenTiming.of(marks[name], 1) for name in runs}
    print("\n| engine | KV | decode tok/s (median) | spread | ttft ms |\n|---|---|---:|---:|---:|")
    for name, t in timing.items():
        engine, kind = name.split(" ")
        print(f"| {engine} | {kind} | {t.decode_tokens_per_s.median:.1f} | {t.decode_tokens_per_s.spread:.1f} | "
              f"{t.ttft_s.median * 1e3:.1f} |")
    print("\nratios of decode tok/s (row / column), same KV kind:")
    for kind in args.kinds:
        names = [n for n in timing if n.endswith(f" {kind}")]
        for a in names:
            for b in names:
                if a != b:
                    ratio = timing[a].decode_tokens_per_s.median / timing[b].decode_tokens_per_s.median
                    print(f"  {kind}: {a.split()[0]} / {b.split()[0]} = {ratio:.2f}")
    if engines:
        bench = llama_bench()
        print(f"\nllama-bench ({bench}), tg{args.new_tokens}, -t {args.threads}:\n"
              f"| KV | fa | llama-bench t/s | ± | runner llama.cpp tok/s | runner / llama-bench |\n"
              f"|---|---|---:|---:|---:|---:|")
        for kind in args.kinds:
            fa = "on" if flash_attention(kind, None) else "off"
            out = subprocess.run([str(bench), "-m", str(gguf), "-t", str(args.threads), "-p", "0", "-n",
                                  str(args.new_tokens), "-ctk", GGML_NAMES[kind], "-ctv", GGML_NAMES[kind],
                                  "-fa", fa, "-r", str(args.repeats), "-o", "json"],
                                 capture_output=True, text=True, check=True)
            (row,) = json.loads(out.stdout)
            ours = timing[f"llama.cpp {kind}"].decode_tokens_per_s.median
            print(f"| {kind} | {fa} | {row['avg_ts']:.1f} | {row['stddev_ts']:.1f} | {ours:.1f} | "
                  f"{ours / row['avg_ts']:.3f} |")


if __name__ == "__main__":
    main()
