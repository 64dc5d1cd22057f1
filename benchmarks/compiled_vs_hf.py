"""The compiled engine vs transformers, eager and compiled: same model, prompts and dtype, one process.

    python benchmarks/compiled_vs_hf.py [--model zoo:smollm2-135m] [--dtypes float32 bfloat16] [--batch-sizes 1]

Variants, all greedy with EOS off (exactly --new-tokens tokens), timed by runner's harness (warm-up, interleaved,
order alternating, device synced), a tick per token:
    compiled     runner's Generator with engine: compiled (static cache, compiled decode step)
    eager        runner's Generator with engine: eager
    hf           transformers' model.generate() (dynamic cache, eager)
    hf-compiled  transformers' model.generate() with its static cache and its compiled forward
                 (cache_implementation="static", CompileConfig(dynamic=False)): what a transformers user would set up
Compile seconds (first call of each compiled variant) are printed on their own lines, never inside a timing.
Per variant: median decode tokens/s (prefill excluded) and its spread; ratios are medians of per-repeat ratios;
bw = fraction of the copy-bandwidth bound (weights + mid-decode cache bytes per step / step time / copy GB/s).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import CompileConfig  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.bench.cells import bandwidth_fraction  # noqa: E402
from runner.infer.cache.registry import estimate_cache_bytes  # noqa: E402
from runner.infer.compiled.engine import engine_for, use_compile_cache  # noqa: E402
from runner.infer.config.decoding import GenerateConfig  # noqa: E402
from runner.infer.config.kinds import DTYPES
from runner.infer.generation.generator import Generator  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import Stopwatch, TokenTiming, copy_bandwidth, on_device, time_interleaved, time_once  # noqa: E402

VARIANTS = ("compiled", "eager", "hf", "hf-compiled")


def real_prompts(n: int) -> list[str]:
    """Different paragraphs of Python's reference manual (stdlib, offline): real English of mixed length."""
    from pydoc_data.topics import topics

    texts = [t.split("\n\n")[1] for t in topics.values() if t.count("\n\n") > 2]
    return [" ".join(texts[i * 7 % len(texts)].split()[:24 + 4 * i]) for i in range(n)]  # cycles past the manual's end


class TickStreamer(BaseStreamer):
    """Ticks once per generated token (generate() puts the prompt first)."""

    def __init__(self, tick):
        self.tick, self.prompt_seen = tick, False

    def put(self, value):
        if self.prompt_seen:
            self.tick()
        self.prompt_seen = True

    def end(self):
        pass


def variants(model, enc, new_tokens: int, outs: dict) -> dict:
    """name → run_once(tick) for the harness; each keeps its last output in `outs`."""
    def ours(engine):
        config = GenerateConfig(max_new_tokens=new_tokens, temperature=0, eos_token_id=[], engine=engine)

        @torch.inference_mode()
        def run_once(tick):
            gen = Generator(model, config)
            tokens = []
            for token in gen.steps(enc.input_ids, enc.attention_mask):
                tokens.append(token)
                tick()
            outs[engine] = torch.stack(tokens, dim=1)
        return run_once

    def hf(static: bool):
        compile_config = CompileConfig(dynamic=False, fullgraph=False, mode="default")
        compile_config._compile_all_devices = True  # transformers compiles by itself only on accelerators
        extra = dict(cache_implementation="static", compile_config=compile_config) if static else {}

        def run_once(tick):
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, streamer=TickStreamer(tick), **extra)
            outs["hf-compiled" if static else "hf"] = out[:, enc.input_ids.shape[1]:]
        return run_once

    return {"compiled": ours("compiled"), "eager": ours("eager"), "hf": hf(False), "hf-compiled": hf(True)}


def append_row(path: str, cells: list) -> None:
    """One row of the suite's markdown table: benchmark | model | dtype | batch | context | variant | tok/s | spread
    | ÷hf | ÷hf-compiled | ÷fp16 | bw | same tokens."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("| " + " | ".join(str(c) for c in cells) + " |\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--markdown", default=None, help="append one markdown row per variant to this file "
                        "(the columns of benchmarks/gpu_suite.sh's table)")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    use_compile_cache()
    for dtype in args.dtypes:
        lm = load_model(args.model, dtype=dtype, device=args.device)
        model, device = lm.model, lm.device
        bandwidth = copy_bandwidth(device)
        print(f"model={args.model} dtype={dtype} device={device} new_tokens={args.new_tokens} "
              f"threads={torch.get_num_threads()} repeats={args.repeats} copy={bandwidth / 1e9:.1f} GB/s "
              f"torch={torch.__version__}")
        for batch in args.batch_sizes:
            enc = lm.tokenizer(real_prompts(batch), return_tensors="pt", padding=True).to(device)
            outs: dict = {}
            chosen = {name: run for name, run in variants(model, enc, args.new_tokens, outs).items()
                      if name in args.variants}
            for name in ("compiled", "hf-compiled"):  # compile apart: the first call of each, timed on its own
                if name in chosen:
                    before = engine_for(model).stats.total_s
                    seconds = time_once(lambda: chosen[name](lambda: None), **on_device(device))
                    compiling_s = engine_for(model).stats.total_s - before
                    detail = (f", of which compiling (or loading) the step {compiling_s:.1f} s"
                              if name == "compiled" else " (compile and one generation)")
                    print(f"compile {name} batch={batch}: first call {seconds:.1f} s{detail}", flush=True)
            watch = Stopwatch()
            marks = time_interleaved(chosen, args.repeats, warmup=1, **on_device(device))
            timings = {name: TokenTiming.of(runs, batch) for name, runs in marks.items()}
            rates = {name: [batch * (len(m) - 1) / (m[-1] - m[0]) for m in runs] for name, runs in marks.items()}
            stats = engine_for(model).stats
            print(f"batch={batch} timed in {watch.lap():.0f} s; engine compiles={stats.compiles} "
                  f"recompiles={stats.recompiles}")
            prompt_len = enc.input_ids.shape[1]
            kv = estimate_cache_bytes(model.config, None, batch, prompt_len + args.new_tokens, model.dtype)
            print(f"{'variant':>12} {'decode tok/s':>12} {'spread':>7} {'bw':>5} "
                  + " ".join(f"{'÷' + b:>13}" for b in ("hf", "hf-compiled", "eager") if b in rates)
                  + "  same tokens as hf")
            for name, timing in timings.items():
                ratio = {b: statistics.median(x / y for x, y in zip(rates[name], rates[b]))
                         for b in ("hf", "hf-compiled", "eager") if b in rates}
                bw = bandwidth_fraction(model, kv, prompt_len, args.new_tokens, timing.itl_s.median, bandwidth)
                same = torch.equal(outs[name], outs["hf"]) if "hf" in outs else "-"
                print(f"{name:>12} {timing.decode_tokens_per_s.median:>12.1f} "
                      f"{timing.decode_tokens_per_s.spread:>7.1f} {bw:>5.2f} "
                      + " ".join(f"{ratio[b]:>13.3f}" for b in ratio) + f"  {same}", flush=True)
                if args.markdown:
                    append_row(args.markdown, ["decode", args.model, dtype, batch, prompt_len, name,
                                               f"{timing.decode_tokens_per_s.median:.1f}",
                                               f"{timing.decode_tokens_per_s.spread:.1f}",
                                               *(f"{ratio[b]:.3f}" if b in ratio else "-"
                                                 for b in ("hf", "hf-compiled")),
                                               "-", f"{bw:.2f}", same])
        del lm, model


if __name__ == "__main__":
    main()
