"""Issue 34's serving targets, each measured and checked: one table of figure, ratio and pass/fail.

    python benchmarks/serve_targets.py --model zoo:smollm2-135m --threads 1   # full: 25 min on 2 busy cores
    python benchmarks/serve_targets.py --model tiny --quick --threads 1       # a smoke run (random tiny llama)

Every load is runner.infer.serve's (build_load: exact-token prompts cut from the pydoc text, exact output lengths,
seeded), every server is fed by `drive` on a `load_clock()` as `mode: serve` does, with the step's defaults
(max batch 16, static max_wait_ms 20, block size 16; chunked prefill --tokens-per-step, default 256, for ours
and transformers alike). Each system serves a small
warm-up load of its own first (excluded). Latencies are from each request's scheduled arrival (metrics.summarize).
SLO: p90 TPOT ≤ 3× a solo decode's TPOT and p90 TTFT ≤ 3× a solo decode's TTFT of the longest prompt (both
measured here first, medians of 3 after a warm-up); a point meets it only with nothing refused or failed.

1. continuous vs static: a Poisson rate sweep (--rates, --requests per point; prompts uniform 32–256 tokens,
   outputs 16–128), our Scheduler and the StaticBatcher on the same requests; the highest rate meeting the SLO for
   each (metrics.max_rate_meeting), also under the TPOT bound alone. Target: continuous ≥ 2× static.
2. vs transformers' continuous batching (TransformersServer): a burst of 16 requests × 128 prompt → 32 output
   tokens (--burst; medians of 2 after a warm-up), and the sweep's highest rate; output tokens/s ours ÷ theirs, at
   an equal or lower p50 TTFT. Target ≥ 3×.
3. admission under one KV budget (--kv-budget-mib; default: fp16 room for 2 of the longest requests) for fp16,
   q8_0, q4_0, kivi4 (--kinds): a burst of 32 mixed requests stepped until the first finishes; the peak running
   requests in the scheduler's timeline against the estimator's (blocks.block_spec, blocks_in: requests admitted
   first come first served while their prompts' blocks fit). Target: within 10 %. Then goodput at the SLO per kind
   on the sweep's highest rate, budget on, against the same load with no budget (compute binds where they match).
   Under the budget, max_running is --budget-running (64), so the budget alone limits admission. --engine
   compiled serves it on CompiledSlots (one step of fixed rows whatever runs; KIVI kinds join at their blocks'
   starts): the budget bounds the blocks the requests hold, while the slots' static cache is allocated whole
   (rows × columns of the kind), as a paged pool would not be.
4. scheduler cost: Scheduler.step() minus its forward (Scheduler.forward_s) per decode step at batch 8
   (benchmarks/serve_scheduler.step_costs, medians), and the same share over the sweep's continuous runs.
   Target ≤ 5 % of a step.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from serve_scheduler import TINY, step_costs  # noqa: E402  (benchmarks/ is the script's directory)
from serve_transformers_cb import cpu_flags  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from runner.infer.compiled.engine import length_bucket  # noqa: E402
from runner.infer.config.kinds import compiled_serve_reason  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text  # noqa: E402
from runner.infer.serve.blocks import block_spec, blocks_in  # noqa: E402
from runner.infer.serve.compiled_slots import CompiledSlots  # noqa: E402
from runner.infer.serve.driver import drive, load_clock  # noqa: E402
from runner.infer.serve.live import SchedulerConfig  # noqa: E402
from runner.infer.serve.load import Lengths, LoadSpec, build_load  # noqa: E402
from runner.infer.serve.metrics import Slo, max_rate_meeting, occupancy, summarize  # noqa: E402
from runner.infer.serve.scheduler import Scheduler  # noqa: E402
from runner.infer.serve.static import StaticBatcher  # noqa: E402
from runner.infer.serve.transformers_cb import TransformersServer, transformers_cb_reason  # noqa: E402

MIB = 2**20
KINDS = ("fp16", "q8_0", "q4_0", "kivi4")
SIZES = {  # full / --quick
    "full": {"rates": [0.25, 0.5, 1.0], "requests": 24, "prompt": (32, 256), "output": (16, 128),
             "burst": (16, 128, 32), "admit": 32, "batch": 8, "steps": 16, "repeats": 3, "burst_repeats": 2},
    "quick": {"rates": [4.0, 16.0], "requests": 4, "prompt": (8, 32), "output": (4, 12),
              "burst": (4, 16, 8), "admit": 12, "batch": 2, "steps": 4, "repeats": 1, "burst_repeats": 1},
}


class Bench:
    """One model, its tokenizer and text, and the step's server settings."""

    def __init__(self, lm, size: dict, max_batch: int, block_size: int, engine: str = "eager",
                 tokens_per_step: int = 256, budget_running: int = 64):
        self.lm, self.model, self.size, self.engine = lm, lm.model, size, engine
        self.tokens_per_step = tokens_per_step  # ours: max_tokens_per_step; transformers': max_batch_tokens
        self.text = load_text("pydoc").text
        self.max_batch, self.block_size = max_batch, block_size
        self.budget_running = budget_running  # max_running under a KV budget (the compiled slots' rows)
        self.columns = length_bucket(max(size["prompt"][1] + size["output"][1], sum(size["burst"][1:])),
                                     lm.model.config.max_position_embeddings)  # the compiled slots' S
        self.warmed: set[tuple[str, str | None, int | None]] = set()  # (system, kind, budget) warm() has served
        self.step_s: list[float] = []  # Scheduler.step() wall times of the sweep's continuous runs
        self.forward_s = 0.0

    def spec(self, rate: float, n: int | None = None, prompt: tuple[int, int] | None = None,
             output: tuple[int, int] | None = None) -> LoadSpec:
        p, o = prompt or self.size["prompt"], output or self.size["output"]
        return LoadSpec(arrival="poisson", rate=rate, num_requests=n or self.size["requests"], warmup_requests=2,
                        prompt_tokens=Lengths("uniform", min=p[0], max=p[1]),
                        output_tokens=Lengths("uniform", min=o[0], max=o[1]))

    def server(self, system: str, kind: str | None = None, budget: int | None = None):
        """Under a budget, max_running is `budget_running`: set above what the budget admits, the budget limits."""
        if system == "continuous":
            config = SchedulerConfig(cache_kind=kind, block_size=self.block_size, kv_budget_bytes=budget,
                                     max_tokens_per_step=self.tokens_per_step,
                                     max_running=self.max_batch if budget is None else self.budget_running)
            if self.engine == "compiled":
                return CompiledSlots(self.model, config, columns=self.columns)
            return Scheduler(self.model, config)
        if system == "static":
            return StaticBatcher(self.model, max_batch_size=self.max_batch, max_wait_ms=20.0)
        return TransformersServer(self.model, max_batch_size=self.max_batch, block_size=self.block_size,
                                  num_blocks=4096, max_batch_tokens=self.tokens_per_step)

    def serve(self, server, load, timed: bool = False):
        """`load` (a Load or requests) on `server` on a fresh load clock → records; the server is closed after."""
        if timed:  # the scheduler's own cost: every step's wall time, and the forwards' share (forward_s)
            inner = server.step

            def step() -> None:
                start = time.perf_counter()
                inner()
                self.step_s.append(time.perf_counter() - start)
            server.step = step
        try:
            records = drive(server, load, load_clock(), time.sleep)
        finally:
            if hasattr(server, "close"):
                server.close()
        if timed:
            self.forward_s += server.forward_s
        return records

    def warm(self, system: str, kind: str | None = None, budget: int | None = None) -> None:
        """The warm-up load, then a burst of 8 at t = 0 (the compiled slots prefill up to 8 prompts a forward, each
        group size its first time eagerly: on a GPU a first call costs); once per server setting in a process."""
        if (system, kind, budget) in self.warmed:
            return
        self.warmed.add((system, kind, budget))
        self.serve(self.server(system, kind, budget),
                   build_load(self.spec(1.0), self.lm.tokenizer, self.text, warmup=True))
        burst = [replace(r, arrival_s=0.0) for r in self.load(self.spec(1.0, n=8)).requests]
        self.serve(self.server(system, kind, budget), burst)

    def load(self, spec: LoadSpec):
        return build_load(spec, self.lm.tokenizer, self.text)


def solo(b: Bench) -> tuple[float, float]:
    """(TTFT, TPOT) in ms of one request alone on our scheduler: the longest prompt, 32 output tokens; medians of 3."""
    spec = b.spec(1.0, n=1, prompt=(b.size["prompt"][1],) * 2, output=(32, 32))
    b.warm("continuous")
    points = [summarize(b.serve(b.server("continuous"), b.load(spec))) for _ in range(3)]
    return (statistics.median(p["p50_ttft_ms"] for p in points), statistics.median(p["p50_tpot_ms"] for p in points))


def sweep(b: Bench, slo: Slo) -> dict[str, dict[float, dict]]:
    """Target 1: each system's point per rate (same requests), in order of rate."""
    out: dict[str, dict[float, dict]] = {"continuous": {}, "static": {}}
    b.warm("static")
    for rate in b.size["rates"]:
        for system in out:
            records = b.serve(b.server(system), b.load(b.spec(rate)), timed=system == "continuous")
            out[system][rate] = summarize(records, slo=slo)
    return out


def burst(b: Bench, system: str) -> dict:
    """Target 2: the burst on `system` (a warm-up first), medians of the repeats' summaries."""
    n, prompt, new = b.size["burst"]
    spec = b.spec(1.0, n=n, prompt=(prompt, prompt), output=(new, new))
    requests = [replace(r, arrival_s=0.0) for r in b.load(spec).requests]
    b.warm(system)
    points = [summarize(b.serve(b.server(system), requests)) for _ in range(b.size["burst_repeats"])]
    return {k: statistics.median(p[k] for p in points) for k in ("output_tokens_per_s", "p50_ttft_ms")}


def predicted_admission(b: Bench, kind: str, budget: int, prompts: list[int], max_running: int) -> int:
    """The estimator's count: requests admitted first come first served while their prompts' blocks fit."""
    spec = block_spec(b.model.config, kind, b.block_size, b.model.dtype)
    free, n = blocks_in(budget, spec), 0
    for p in prompts:
        if n >= max_running or spec.blocks_for(p) > free:
            break
        free -= spec.blocks_for(p)
        n += 1
    return n


def admission(b: Bench, kind: str, budget: int) -> dict:
    """Target 3a: a burst on a budgeted scheduler, stepped until the first request finishes: peak running, the
    prediction, blocks of the budget, preemptions so far."""
    requests = [replace(r, arrival_s=0.0) for r in b.load(b.spec(1.0, n=b.size["admit"])).requests]
    scheduler = b.server("continuous", kind=kind, budget=budget)
    scheduler.clock = load_clock()
    records = [scheduler.submit(r) for r in requests]
    while scheduler.busy and not any(r.finish for r in records):
        scheduler.step()
    spec = scheduler.pool.spec
    return {"peak": occupancy(scheduler.timeline)["peak_running"],
            "predicted": predicted_admission(b, kind, budget, [len(r.prompt_ids) for r in requests],
                                              b.budget_running),
            "blocks": scheduler.pool.total, "block_bytes": spec.block_bytes, "reserve": spec.reserve,
            "preemptions": sum(r.preemptions for r in records)}


def goodput(b: Bench, kind: str | None, budget: int | None, rate: float, slo: Slo) -> dict:
    """Target 3b: the sweep's load at `rate` on a scheduler of `kind` under `budget` (None: unbounded)."""
    b.warm("continuous", kind=kind, budget=budget)
    scheduler = b.server("continuous", kind=kind, budget=budget)
    point = summarize(b.serve(scheduler, b.load(b.spec(rate))), slo=slo) | occupancy(scheduler.timeline)
    print(f"   goodput {kind or 'none'} at {rate:g}/s: {point['goodput_per_s']:.3f} req/s, "
          f"{point['output_tokens_per_s']:.1f} tok/s, mean running {point['mean_running']:.1f}, p90 TTFT "
          f"{point['p90_ttft_ms']:.0f} ms, p90 TPOT {point['p90_tpot_ms']:.1f} ms", flush=True)
    return point


def verdict(value: float | None, target: float, higher: bool = True) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return "pass" if (value >= target if higher else value <= target) else "FAIL"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m", help="a model id, or tiny (random, in-process)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--rates", type=float, nargs="+", help="Poisson rates of the sweep (req/s)")
    parser.add_argument("--requests", type=int, help="requests per sweep point")
    parser.add_argument("--burst", type=int, nargs=3, metavar=("N", "PROMPT", "OUTPUT"),
                        help="target 2's burst: N requests of PROMPT tokens → OUTPUT tokens at t = 0 "
                             "(default 16 128 32)")
    parser.add_argument("--kv-budget-mib", type=float, help="target 3's budget (default: fp16 room for two of the "
                        "longest requests)")
    parser.add_argument("--goodput-rates", type=float, nargs="+", help="target 3's goodput per kind at each of "
                        "these Poisson rates (default: the sweep's highest alone)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--engine", choices=("eager", "compiled"), default="eager",
                        help="our continuous system's engine (compiled: CompiledSlots, compiled before any clock, "
                             "target 3's budgeted runs too, KIVI without sinks included; the static baseline stays "
                             "eager)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), help="target 3's cache kinds (fp16 always: the "
                        "ratios' baseline)")
    parser.add_argument("--budget-running", type=int, default=64, help="target 3's max_running under the budget: "
                        "the compiled slots' rows, each computed every step (on CPU, fewer rows cost less)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens-per-step", type=int, default=256,
                        help="tokens one step (forward) may take, ours and transformers' alike (prefill chunks)")
    parser.add_argument("--targets", type=int, nargs="+", default=[1, 2, 3, 4], help="which targets to run")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; on a shared 2-core "
                        "machine 1 is several times faster than 2)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    size = dict(SIZES["quick" if args.quick else "full"])
    size["rates"] = sorted(args.rates or size["rates"])
    size["requests"] = args.requests or size["requests"]
    size["burst"] = tuple(args.burst or size["burst"])
    hf_logging.disable_progress_bar()
    lm = (load_model(config=TINY, seed=0, device=args.device) if args.model == "tiny"
          else load_model(args.model, dtype=args.dtype, device=args.device))
    b = Bench(lm, size, max_batch=16, block_size=16, engine=args.engine,
              tokens_per_step=args.tokens_per_step, budget_running=args.budget_running)
    started = time.perf_counter()
    print(f"model={args.model} dtype={args.dtype} engine={args.engine} device={args.device} "
          f"threads={torch.get_num_threads()} cores={os.cpu_count()} "
          f"commit={commit()} date={datetime.date.today()} load={os.getloadavg()[0]:.1f}")
    print(f"cpu flags: {cpu_flags()}")

    ttft0, tpot0 = solo(b)
    slo = Slo(ttft_ms=3 * ttft0, tpot_ms=3 * tpot0)
    slo_tpot = Slo(tpot_ms=3 * tpot0)
    print(f"solo decode ({size['prompt'][1]}-token prompt, 32 tokens): TTFT {ttft0:.0f} ms, TPOT {tpot0:.1f} ms → "
          f"SLO p90 TTFT ≤ {slo.ttft_ms:.0f} ms, p90 TPOT ≤ {slo.tpot_ms:.1f} ms")

    # 1. continuous vs static (the sweep; targets 2 and 3 reuse its top point, else serve it themselves)
    points: dict[str, dict[float, dict]] = {"continuous": {}}
    rows: list[tuple[str, str, str, str]] = []
    if 1 in args.targets:
        points = sweep(b, slo)
        print(f"\n1. Poisson sweep: {size['requests']} requests a point, prompts "
              f"{size['prompt'][0]}–{size['prompt'][1]}, outputs {size['output'][0]}–{size['output'][1]} tokens, "
              f"max batch {b.max_batch}")
        print(f"{'rate':>5} {'system':>10} {'tok/s':>7} {'p50 TTFT':>9} {'p90 TTFT':>9} {'p90 TPOT':>9} "
              f"{'goodput':>8} {'meets':>6} {'TPOT only':>9}")
        for rate in size["rates"]:
            for system, by_rate in points.items():
                p = by_rate[rate]
                meets = max_rate_meeting({rate: p}, slo) is not None
                meets_tpot = max_rate_meeting({rate: p}, slo_tpot) is not None
                print(f"{rate:>5g} {system:>10} {p['output_tokens_per_s']:7.1f} {p['p50_ttft_ms']:9.0f} "
                      f"{p['p90_ttft_ms']:9.0f} {p['p90_tpot_ms']:9.1f} {p['goodput_per_s']:8.3f} {str(meets):>6} "
                      f"{str(meets_tpot):>9}")
        lowest = size["rates"][0]
        for label, bound in (("TTFT+TPOT", slo), ("TPOT only", slo_tpot)):
            best = {system: max_rate_meeting(by_rate, bound) for system, by_rate in points.items()}
            cont, stat = best["continuous"], best["static"]
            if cont is None:
                figure, ratio, ok = "continuous meets no rate", "n/a", "FAIL"
            elif stat is None:  # static misses even the lowest rate: its highest is below it
                figure, ratio = f"{cont:g} vs < {lowest:g} req/s", f"> {cont / lowest:.2f}"
                ok = "pass" if cont / lowest >= 2 else "n/a"
            else:
                figure, ratio, ok = f"{cont:g} vs {stat:g} req/s", f"{cont / stat:.2f}", verdict(cont / stat, 2.0)
            rows.append((f"1. continuous ÷ static, max rate at SLO ({label})", figure, ratio + " (≥ 2)", ok))

    top = size["rates"][-1]
    if top not in points["continuous"] and {2, 3} & set(args.targets):
        b.warm("continuous")
        points["continuous"][top] = summarize(b.serve(b.server("continuous"), b.load(b.spec(top)), timed=True),
                                              slo=slo)
    if 2 in args.targets:  # 2. vs transformers
        reason = "--skip-transformers" if args.skip_transformers else transformers_cb_reason(b.model)
        if reason:
            rows.append(("2. ours ÷ transformers CB", f"not run: {reason}", "", "n/a"))
        else:
            ours, theirs = burst(b, "continuous"), burst(b, "transformers")
            ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
            n, prompt, new = size["burst"]
            print(f"\n2. burst {n}×{prompt}→{new} (median of {size['burst_repeats']}): ours "
                  f"{ours['output_tokens_per_s']:.1f} tok/s, p50 TTFT {ours['p50_ttft_ms']:.0f} ms; "
                  f"transformers {theirs['output_tokens_per_s']:.1f} tok/s, "
                  f"p50 TTFT {theirs['p50_ttft_ms']:.0f} ms")
            lower = ours["p50_ttft_ms"] <= theirs["p50_ttft_ms"]
            rows.append((f"2. ours ÷ transformers CB, burst {n}×{prompt}→{new} tok/s",
                         f"{ours['output_tokens_per_s']:.1f} vs {theirs['output_tokens_per_s']:.1f} "
                         f"(p50 TTFT {ours['p50_ttft_ms']:.0f} vs {theirs['p50_ttft_ms']:.0f} ms)",
                         f"{ratio:.2f} (≥ 3)", verdict(ratio, 3.0) if lower else "FAIL (TTFT)"))
            b.warm("transformers")
            hf = summarize(b.serve(b.server("transformers"), b.load(b.spec(top))), slo=slo)
            mine = points["continuous"][top]
            ratio = mine["output_tokens_per_s"] / hf["output_tokens_per_s"]
            lower = mine["p50_ttft_ms"] <= hf["p50_ttft_ms"]
            print(f"   Poisson {top:g}/s: transformers {hf['output_tokens_per_s']:.1f} tok/s, p50 TTFT "
                  f"{hf['p50_ttft_ms']:.0f} ms, "
                  f"p90 TPOT {hf['p90_tpot_ms']:.1f} ms, goodput {hf['goodput_per_s']:.3f}/s")
            rows.append((f"2. ours ÷ transformers CB, Poisson {top:g}/s tok/s",
                         f"{mine['output_tokens_per_s']:.1f} vs {hf['output_tokens_per_s']:.1f} "
                         f"(p50 TTFT {mine['p50_ttft_ms']:.0f} vs {hf['p50_ttft_ms']:.0f} ms)",
                         f"{ratio:.2f} (≥ 3)", verdict(ratio, 3.0) if lower else "FAIL (TTFT)"))

    if 3 in args.targets:  # 3. admission under one KV budget
        fp16 = block_spec(b.model.config, "fp16", b.block_size, b.model.dtype)
        longest = size["prompt"][1] + size["output"][1]
        budget = (int(args.kv_budget_mib * MIB) if args.kv_budget_mib
                  else 2 * fp16.blocks_for(longest) * fp16.block_bytes)
        wanted = ["fp16", *(kind for kind in args.kinds if kind != "fp16")]
        skipped = {kind: reason for kind in wanted
                   if b.engine == "compiled" and (reason := compiled_serve_reason(kind))}
        kinds = [kind for kind in wanted if kind not in skipped]
        admitted = {kind: admission(b, kind, budget) for kind in kinds}
        base = points["continuous"][top]  # the same load, the model's dtype, no budget
        good = {kind: goodput(b, kind, budget, top, slo) for kind in kinds}
        curve = {rate: {kind: good[kind] if rate == top else goodput(b, kind, budget, rate, slo) for kind in kinds}
                 | {"none": base if rate == top else goodput(b, None, None, rate, slo)}
                 for rate in sorted(set(args.goodput_rates or [top]))}
        print(f"\n3. KV budget {budget / MIB:.2f} MiB; admission: a burst of {size['admit']} sweep-shaped requests, "
              f"stepped to the first finish; goodput: Poisson {top:g}/s")
        print(f"{'kind':>6} {'blocks':>6} {'reserve':>7} {'peak':>5} {'predicted':>9} {'÷ fp16':>7} "
              f"{'pred ÷ fp16':>11} {'preempt':>7} {'goodput':>8} {'mean run':>8} {'tok/s':>7} "
              f"{'p90 TPOT':>8} {'p90 TTFT':>8}")
        for kind in kinds:
            a, g = admitted[kind], good[kind]
            print(f"{kind:>6} {a['blocks']:>6} {a['reserve']:>7} {a['peak']:>5} {a['predicted']:>9} "
                  f"{a['peak'] / admitted['fp16']['peak']:7.2f} {a['predicted'] / admitted['fp16']['predicted']:11.2f} "
                  f"{a['preemptions']:>7} {g['goodput_per_s']:8.3f} {g['mean_running']:8.2f} "
                  f"{g['output_tokens_per_s']:7.1f} {g['p90_tpot_ms']:8.1f} {g['p90_ttft_ms']:8.0f}")
        print(f"{'none':>6} {'':>6} {'':>7} {'':>5} {'':>9} {'':>7} {'':>11} {'':>7} "
              f"{base['goodput_per_s']:8.3f} {'':>8} {base['output_tokens_per_s']:7.1f} "
              f"{base['p90_tpot_ms']:8.1f} {base['p90_ttft_ms']:8.0f}   (model dtype, no budget: the sweep's point)")
        for kind, reason in skipped.items():
            print(f"{kind:>6} not run on the compiled slots: {reason}")
        print(f"\n3b. goodput req/s at the SLO against rate (budget {budget / MIB:.2f} MiB; none: no budget)")
        print(f"{'rate':>6} " + " ".join(f"{kind:>7}" for kind in (*kinds, "none")) + "   mean running")
        for rate, by_kind in curve.items():
            print(f"{rate:>6g} " + " ".join(f"{by_kind[k]['goodput_per_s']:7.3f}" for k in (*kinds, "none")) + "   "
                  + " ".join(f"{by_kind[k]['mean_running']:.1f}" if "mean_running" in by_kind[k] else "—"
                           for k in (*kinds, "none")))  # the sweep's own point has no timeline
        for kind in kinds:
            a = admitted[kind]
            error = abs(a["peak"] - a["predicted"]) / a["predicted"] if a["predicted"] else math.nan
            rows.append((f"3. {kind}: peak running vs estimator", f"{a['peak']} vs {a['predicted']}",
                         f"{1 + error:.2f} (≤ 1.10)" if not math.isnan(error) else "n/a", verdict(error, 0.10, False)))
        for kind in kinds[1:]:
            ratio = admitted[kind]["peak"] / admitted["fp16"]["peak"]
            spec = block_spec(b.model.config, kind, b.block_size, b.model.dtype)
            rows.append((f"3. {kind} ÷ fp16 peak running", f"fp16 ÷ {kind} block bytes "
                         f"{fp16.block_bytes / spec.block_bytes:.2f}, reserve {spec.reserve} blocks", f"{ratio:.2f}",
                         "info"))

    if 4 in args.targets:  # 4. scheduler cost
        costs = step_costs(b.model, size["batch"], size["steps"], size["repeats"], 32, None)
        share = costs["scheduler_ms"] / costs["step_ms"]
        load_share = 1 - b.forward_s / sum(b.step_s) if b.step_s else math.nan
        print(f"\n4. batch {size['batch']}: step {costs['step_ms']:.2f} ms, forward {costs['forward_ms']:.2f} ms, "
              f"scheduler {costs['scheduler_ms']:.3f} ms; over the sweep's continuous runs: {len(b.step_s)} steps, "
              f"scheduler {100 * load_share:.2f} % of step time")
        rows.append((f"4. scheduler ÷ decode step, batch {size['batch']}", f"{costs['scheduler_ms']:.3f} of "
                     f"{costs['step_ms']:.2f} ms", f"{100 * share:.2f} % (≤ 5 %)", verdict(share, 0.05, False)))
        rows.append(("4. scheduler ÷ step time, sweep loads", f"{len(b.step_s)} steps",
                     f"{100 * load_share:.2f} % (≤ 5 %)", verdict(load_share, 0.05, False)))

    print("\n| target | measured | ratio (target) | result |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
