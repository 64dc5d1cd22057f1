"""Continuous batching on the compiled engine (CompiledSlots) against the eager scheduler, same requests; and the
slots' mixed forwards against prefilling apart (CompiledSlots(mixed=False)).

    python benchmarks/serve_compiled.py                                   # the tiny random llama (no download)
    python benchmarks/serve_compiled.py --model zoo:smollm2-135m --batch 1 4 8

Per max_running B and per arrival pattern (all at t = 0; Poisson at --rate): --requests requests of mixed prompt
and exact output lengths, served by the eager Scheduler and by CompiledSlots (B rows = batch bucket of B, S =
--columns), real clock, variants interleaved (runner.infer.measure.timing's harness, one untimed warm-up run each).
Output tokens / makespan: median over repeats, and the ratios compiled ÷ eager and compiled ÷ apart (`apart`: the
same slots with every prompt prefilled in a forward of its own, where the native step would have mixed it into the
decode rows' forward; the same where it does not serve). Compile time is apart: the warm-up
compile of the one shape (kind, B, S, 1) when the first server of that B is built, before any timing; `recompiles`
counts graphs made during the timed loads (should be 0). `same`: every request's tokens equal between the two.

Measured (2026-11-26, shared 2-core CPU, 1 thread, load average ~2; SmolLM2-135M fp32, --repeats 2 --max-output 32
--rate 2): compiled ÷ eager output tok/s 1.14 / 1.31 (B=1, t=0 / Poisson), 1.36 / 1.20 (B=4), 1.44 / 1.17 (B=8);
0 recompiles, same tokens everywhere; compile 105-262 s per B cold (under contention), 13 s from inductor's cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from serve_scheduler import TINY, make_requests  # noqa: E402  (benchmarks/ is the script's directory)

from runner.infer.compiled.engine import engine_for  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import time_interleaved  # noqa: E402
from runner.infer.serve.compiled_slots import CompiledSlots  # noqa: E402
from runner.infer.serve.driver import drive  # noqa: E402
from runner.infer.serve.live import SchedulerConfig  # noqa: E402
from runner.infer.serve.requests import Request  # noqa: E402
from runner.infer.serve.scheduler import Scheduler  # noqa: E402


def compare(model, requests: list[Request], max_running: int, columns: int, repeats: int,
            kind: str | None) -> dict:
    """Output tokens/s of the eager scheduler and of CompiledSlots, mixed and apart, on the same requests; compile s,
    recompiles."""
    config = SchedulerConfig(cache_kind=kind, max_running=max_running)
    engine = engine_for(model)
    before = engine.stats.reading()
    CompiledSlots(model, config, columns=columns)  # the warm-up compile, outside every timing
    compile_s, compiles, _ = (b - a for a, b in zip(before, engine.stats.reading()))
    recompiles_at = engine.stats.recompiles
    outputs: dict[str, list[list[int]]] = {}

    def run(name):
        def run_once(tick):
            start = time.perf_counter()

            def clock() -> float:
                return time.perf_counter() - start

            server = (Scheduler(model, config) if name == "eager"
                      else CompiledSlots(model, config, columns=columns, mixed=name == "compiled"))
            records = drive(server, requests, clock, time.sleep)
            tick()
            outputs[name] = [r.output_ids for r in records]
        return run_once

    marks = time_interleaved({name: run(name) for name in ("eager", "compiled", "apart")}, repeats)
    tokens = sum(r.max_new_tokens for r in requests)
    rates = {name: statistics.median(tokens / m[-1] for m in runs) for name, runs in marks.items()}
    return {**rates, "compile_s": compile_s, "compiles": compiles,
            "recompiles": engine.stats.recompiles - recompiles_at,
            "same": outputs["eager"] == outputs["compiled"] == outputs["apart"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (random, in-process) or a model id (zoo:smollm2-135m)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kind", default=None, help="cache kind (default: the model's dtype)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="max_running values")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=64, help="outputs draw 8..this many tokens")
    parser.add_argument("--columns", type=int, default=256, help="S: the compiled cache's columns")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per s of the second load")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    lm = load_model(config=TINY, seed=0, device=args.device) if args.model == "tiny" else load_model(
        args.model, dtype=args.dtype, device=args.device)
    model = lm.model
    print(f"model={args.model} dtype={args.dtype} kind={args.kind} device={args.device} "
          f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f}")
    print(f"{args.requests} requests, prompts 8-96, outputs 8-{args.max_output} tokens (exact), S={args.columns}; "
          f"output tok/s (median of {args.repeats})")
    print(f"{'batch':>5} {'arrivals':>12} {'eager':>8} {'compiled':>9} {'ratio':>6} {'apart':>8} {'ratio':>6} "
          f"{'compile s':>9} {'graphs':>6} {'recompiles':>10} {'same':>5}")
    for batch in args.batch:
        for rate in (0.0, args.rate):
            requests = make_requests(args.requests, model.config.vocab_size, (8, 96), (8, args.max_output), seed=1,
                                 rate=rate)
            r = compare(model, requests, batch, args.columns, args.repeats, args.kind)
            arrivals = f"Poisson {rate:g}/s" if rate else "all at t=0"
            print(f"{batch:>5} {arrivals:>12} {r['eager']:8.1f} {r['compiled']:9.1f} "
                  f"{r['compiled'] / r['eager']:6.2f} {r['apart']:8.1f} {r['compiled'] / r['apart']:6.2f} "
                  f"{r['compile_s']:9.1f} {r['compiles']:>6} "
                  f"{r['recompiles']:>10} {str(r['same']):>5}")
    print(f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
