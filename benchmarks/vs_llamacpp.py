"""Our engines against llama.cpp, and llama.cpp through runner against llama-bench, in one process.

    python benchmarks/vs_llamacpp.py [--model zoo:smollm2-135m] [--kinds fp16 q8_0 q4_0] [--threads 2]

Engines eager, compiled and llama.cpp × KV kinds, batch 1, greedy, EOS ignored: every variant timed by the one
harness, interleaved (one warm-up each, order alternating), tokens/s of the decode (prefill left out) as medians and
spreads, then every ratio. Then llama-bench (built from the sdist's vendored llama.cpp, cached) on the same GGUF,
tg<new tokens>, the same threads and K/V types (-ctk/-ctv, flash attention as runner sets it): runner's llama.cpp
over llama-bench is the overhead of the Python binding and our loop (target: within 10 %).

Weights differ between the sides: ours are the zoo GGUF dequantized to float32 (transformers), llama.cpp runs the
GGUF as it is (SmolLM2: Q4_1). The table says tokens/s per side; it is not a comparison of equal arithmetic.

    python benchmarks/vs_llamacpp.py --weights f32 q8_0 q4_0 q4_1 file --perplexity [--context 512 --chunks 8]

prints, per weight precision, the perplexity of the evaluation text (pydoc) on our engine and on llama-perplexity,
the same GGUF on both sides, scored the way llama-perplexity scores (issue 37 item 6: quality beside llama.cpp's own).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.files import cache_folder, cache_write  # noqa: E402
from runner.infer.bench.cells import step_weight_bytes  # noqa: E402
from runner.infer.compiled.engine import CompiledEngine, engine_for  # noqa: E402
from runner.infer.config.llamacpp import GGML_NAMES, LlamaCppOptions, flash_attention  # noqa: E402
from runner.infer.kernels.native import vector_flags  # noqa: E402
from runner.infer.llamacpp.engine import LlamaCppEngine  # noqa: E402
from runner.infer.llamacpp.gguf_file import model_gguf, written_gguf  # noqa: E402
from runner.infer.llamacpp.install import llama_tool  # noqa: E402
from runner.infer.loading.models import load_model, source_gguf  # noqa: E402
from runner.infer.loading.texts import load_text, token_windows  # noqa: E402
from runner.infer.measure.timing import TokenTiming, device_name, read_bandwidth, time_interleaved  # noqa: E402
from runner.infer.quant.gguf_tensors import gguf_tensors  # noqa: E402
from runner.infer.select.speed import compile_pairs, compiled_run, greedy_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--kinds", nargs="+", default=["fp16", "q8_0", "q4_0"])
    parser.add_argument("--engines", nargs="+", default=["eager", "compiled", "llama.cpp"])
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, help="compare weight precisions instead (below)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--perplexity", action="store_true", help="with --weights: perplexity on each side (below)")
    parser.add_argument("--context", type=int, default=512, help="--perplexity: tokens a chunk (llama's -c)")
    parser.add_argument("--chunks", type=int, default=8, help="--perplexity: chunks scored")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    if args.weights and args.perplexity:
        perplexity_table(args)
    elif args.weights:
        weights_table(args)
    else:
        kv_table(args)


def kv_table(args) -> None:
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
        bench = llama_tool()
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



# --- weights: our compiled engine on a GGUF's own bits against llama.cpp's tools on the same file -------------------

WEIGHTS = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "file")  # file: the model's own GGUF as it is (zoo: Q4_1, Q4_K_M)
KV = "fp16"  # both sides' K/V in f16 (llama.cpp's default)


def weights_table(args) -> None:
    """Per weight precision: our compiled engine (batch 1 and 4, K/V fp16) timed with the one harness, and llama-bench
    (batch 1) / llama-batched-bench (-npl 4) on the very GGUF our weights were kept from, in alternating rounds;
    tokens/s medians, spreads, ratios, and the fraction of the read bandwidth (measured here, before and between
    rounds) that each side's weight bytes per step reach at batch 1. "ours" is the engine as it runs (its native
    C++ step where it serves); "graph" the same engine with every step inductor's compiled graph, timed in the same
    rounds (native ÷ graph: what the C++ step buys). A row is printed as soon as it is measured."""
    base = load_model(args.model, dtype="float32", device="cpu")
    prompt = torch.tensor(token_windows(base.tokenizer, load_text("pydoc"), args.prompt_len, 1))
    steps, columns = args.new_tokens - 1, args.prompt_len + args.new_tokens
    bandwidth = [read_bandwidth(torch.device("cpu"))]
    print(f"model={args.model} threads={args.threads} prompt={args.prompt_len} new_tokens={args.new_tokens} "
          f"rounds={args.rounds}×{args.repeats} K/V={KV}\ncpu: {device_name(torch.device('cpu'))}; "
          f"flags: {' '.join(vector_flags())}\n")
    print("| weights | GGUF | batch | ours tok/s | ± | graph tok/s | ours ÷ graph | llama.cpp tok/s | ± | "
          "ours / llama.cpp | weight MB/step ours / theirs | bandwidth fraction ours / theirs | graph compile s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|", flush=True)
    for weights in args.weights:
        model, path = _weights_model(base, args.model, weights)
        engines = {"ours": engine_for(model), "graph": CompiledEngine(model, native=False)}
        runs, compile_s = {}, 0.0
        for b in args.batches:
            for name, engine in engines.items():  # the native step compiles nothing: the graph's seconds
                compile_s += compile_pairs({name: (model, KV)}, prompt.repeat(b, 1), steps, columns, engine)[name]
                runs[f"{name} {b}"] = compiled_run(model, prompt.repeat(b, 1), steps, KV, columns, engine)
        rates: dict[str, list] = {name: [] for name in [*runs, *(f"llama.cpp {b}" for b in args.batches)]}
        for _ in range(args.rounds):
            marks = time_interleaved(runs, args.repeats)
            for name, b in ((name, int(name.split()[1])) for name in runs):
                rates[name] += [b * (len(m) - 1) / (m[-1] - m[0]) for m in marks[name]]  # decode tokens/s a repeat
            for b in args.batches:
                rates[f"llama.cpp {b}"] += _llama_rates(path, b, args)
            bandwidth.append(read_bandwidth(torch.device("cpu")))
        read, bw = (step_weight_bytes(model), _file_step_bytes(path)), statistics.median(bandwidth)
        for b in args.batches:
            a, g, t = (statistics.median(rates[f"{name} {b}"]) for name in ("ours", "graph", "llama.cpp"))
            spread = {name: max(rates[f"{name} {b}"]) - min(rates[f"{name} {b}"]) for name in ("ours", "llama.cpp")}
            fractions = f"{read[0] * a / bw:.2f} / {read[1] * t / bw:.2f}" if b == 1 else ""
            print(f"| {weights} | {path.name} | {b} | {a:.1f} | {spread['ours']:.1f} | {g:.1f} | {a / g:.2f} | "
                  f"{t:.1f} | {spread['llama.cpp']:.1f} | {a / t:.2f} | {read[0] / 1e6:.0f} / {read[1] / 1e6:.0f} | "
                  f"{fractions} | {compile_s:.0f} |", flush=True)
        del model, engines, runs
    print(f"\nread bandwidth: median {statistics.median(bandwidth) / 1e9:.1f} GB/s, spread "
          f"{(max(bandwidth) - min(bandwidth)) / 1e9:.1f} ({len(bandwidth)} measurements, before and between rounds)")


def perplexity_table(args) -> None:
    """Per weight precision: perplexity of the evaluation text on our engine (the GGUF's bits through our kernels)
    and on llama-perplexity (the very file), scored as llama-perplexity scores: the text's tokens in chunks of
    `context`, each chunk's first token the BOS where the tokenizer adds one, the second half of each chunk's
    predictions scored. Beside each: ΔNLL against the f32 row of the same side (nats a token)."""
    base = load_model(args.model, dtype="float32", device="cpu")
    tokens, path = _perplexity_text(base.tokenizer, args.context * args.chunks)
    print(f"model={args.model} threads={args.threads} context={args.context} chunks={args.chunks} text={path.name} "
          f"({len(tokens)} tokens)\ncpu: {device_name(torch.device('cpu'))}; flags: {' '.join(vector_flags())}\n")
    print("| weights | GGUF | ours PPL | ± | llama.cpp PPL | ± | ours / llama.cpp | ΔNLL vs f32 ours / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---|", flush=True)
    reference: dict[str, float] = {}
    for weights in args.weights:
        model, gguf = _weights_model(base, args.model, weights)
        ours = _our_perplexity(model, base.tokenizer, tokens, args.context, args.chunks)
        theirs = _llama_perplexity(gguf, path, args)
        if weights == "f32":
            reference = {"ours": math.log(ours[0]), "theirs": math.log(theirs[0])}
        delta = (f"{math.log(ours[0]) - reference['ours']:+.4f} / {math.log(theirs[0]) - reference['theirs']:+.4f}"
                 if reference else "(no f32 row)")
        print(f"| {weights} | {gguf.name} | {ours[0]:.4f} | {ours[1]:.4f} | {theirs[0]:.4f} | {theirs[1]:.4f} | "
              f"{ours[0] / theirs[0]:.4f} | {delta} |", flush=True)
        del model


def _perplexity_text(tokenizer, tokens: int) -> tuple[list[int], Path]:
    """The first `tokens` tokens of the evaluation text (with a little more text after, so both tokenizers see
    whole words at the end) → (our token ids, the text file llama-perplexity reads, cached)."""
    body = load_text("pydoc").text
    cut = len(body)
    while len(tokenizer(body[:cut // 2])["input_ids"]) > tokens * 1.05:
        cut //= 2
    text = body[:cut]
    path = cache_folder("data") / f"perplexity-{hashlib.sha256(text.encode()).hexdigest()[:16]}.txt"
    if not path.exists():
        cache_write(path, text)
    return tokenizer(text)["input_ids"], path


@torch.inference_mode()
def _our_perplexity(model, tokenizer, tokens: list[int], context: int, chunks: int) -> tuple[float, float]:
    """(perplexity, its ± as llama-perplexity prints it) over the first `chunks` whole chunks of `tokens`, scored as
    it scores."""
    bos = tokenizer("")["input_ids"][:1]  # the BOS the tokenizer adds, or none
    first, nll = context // 2, []
    for start in range(0, min(chunks, len(tokens) // context) * context, context):
        chunk = torch.tensor([(bos or tokens[start:start + 1]) + tokens[start + 1:start + context]])
        logits = model(input_ids=chunk, use_cache=False).logits[0, first:context - 1].float()
        nll += (-logits.log_softmax(-1).gather(1, chunk[0, first + 1:, None])[:, 0]).tolist()
    mean = statistics.fmean(nll)
    return math.exp(mean), math.exp(mean) * statistics.stdev(nll) / math.sqrt(len(nll) - 1)


def _llama_perplexity(gguf: Path, text: Path, args) -> tuple[float, float]:
    """(perplexity, ±) of llama-perplexity on `text`, chunks of args.context, its own tokenizer."""
    out = subprocess.run([str(llama_tool("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c",
                          str(args.context), "-b", str(args.context), "--chunks", str(args.chunks), "-t",
                          str(args.threads)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no estimate:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1)), float(found.group(2))


def _weights_model(base, source: str, weights: str):
    """(our model, the GGUF llama.cpp runs) for a precision: float32 / bfloat16 copies of the model beside an f32 /
    bf16 GGUF of it; the quantized ones loaded from that GGUF with model.quantization: gguf."""
    if weights == "file":
        return load_model(source, device="cpu", quantization="gguf").model, model_gguf(source, None, None)
    path = written_gguf(base.model, base.tokenizer, weights.upper(), source_gguf(source))
    if weights in ("f32", "bf16"):
        return copy.deepcopy(base.model).to(torch.float32 if weights == "f32" else torch.bfloat16), path
    return load_model(str(path), device="cpu", quantization="gguf").model, path


def _llama_rates(path: Path, batch: int, args) -> list[float]:
    """Decode tokens/s (all sequences) of llama.cpp's own tools on `path`, one value per repeat."""
    common = ["-m", str(path), "-t", str(args.threads), "-ctk", "f16", "-ctv", "f16"]
    if batch == 1:
        out = subprocess.run([str(llama_tool()), *common, "-p", "0", "-n", str(args.new_tokens), "-r",
                              str(args.repeats), "-o", "json"], capture_output=True, text=True, check=True)
        (row,) = json.loads(out.stdout)
        return [float(v) for v in row["samples_ts"]]
    rates = []
    for _ in range(args.repeats):
        out = subprocess.run([str(llama_tool("llama-batched-bench")), *common, "-npp", str(args.prompt_len), "-ntg",
                              str(args.new_tokens), "-npl", str(batch), "-c",
                              str(batch * (args.prompt_len + args.new_tokens) + 16), "--output-format", "jsonl"],
                             capture_output=True, text=True, check=True)
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        rates.append(float(rows[-1]["speed_tg"]))
    return rates


def _file_step_bytes(path: Path) -> int:
    """The same for the GGUF llama.cpp reads: its tensors but token_embd when the file has its own output."""
    tensors = gguf_tensors(path)
    total = sum(t.n_bytes for t in tensors.values())
    return total - tensors["token_embd.weight"].n_bytes if "output.weight" in tensors else total


if __name__ == "__main__":
    main()
