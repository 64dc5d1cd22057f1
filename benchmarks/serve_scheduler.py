"""The continuous-batching scheduler's own cost per step, and its throughput against static batching.

    python benchmarks/serve_scheduler.py                         # the tiny random llama (no download)
    python benchmarks/serve_scheduler.py --model zoo:smollm2-135m --batch 1 4 8 --requests 16

Part 1, per batch size B: B requests prefilled, then decode steps timed (runner.infer.measure.timing's harness,
warm-up excluded, variants interleaved). Per step, medians over steps and repeats:
    step            Scheduler.step() wall time
    forward         of which inside the batched forward + argmax (Scheduler.forward_s)
    scheduler       step − forward: queues, blocks, bookkeeping (the issue's target: ≤ 5 % of a decode step)
    plain step      one decode step of our DecodeState on a left-padded batch of the same B (one DynamicCache):
                    what the rows cache's per-request split and stacking cost shows against it
Part 2: a mixed-length load (Poisson arrivals at --rate, or all at t = 0; prompt and output lengths drawn from a
seed, exact output lengths) served by the continuous scheduler and by the static baseline (max_batch_size =
max_running, max_wait_ms), real clock: output tokens / makespan (median of repeats), median TTFT and p90 E2E
(from the scheduled arrival, over all repeats), the ratio, and whether every request got the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from runner.infer.cache.registry import make_cache  # noqa: E402
from runner.infer.decode.forward import DecodeState  # noqa: E402
from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.measure.timing import percentile, time_interleaved  # noqa: E402
from runner.infer.serve.driver import drive  # noqa: E402
from runner.infer.serve.live import SchedulerConfig  # noqa: E402
from runner.infer.serve.requests import Request  # noqa: E402
from runner.infer.serve.scheduler import Scheduler  # noqa: E402
from runner.infer.serve.static import StaticBatcher  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def make_requests(n: int, vocab: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0,
              rate: float = 0.0) -> list[Request]:
    """n requests of uniform prompt and (exact) output lengths; Poisson arrivals at `rate` per s (0: all at t=0)."""
    g = torch.Generator().manual_seed(seed)
    out, t = [], 0.0
    for i in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        m = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
        ids = tuple(torch.randint(3, vocab - 3, (p,), generator=g).tolist())
        out.append(Request(i, t, ids, max_new_tokens=m, min_new_tokens=m))
        t += float(torch.empty(1).exponential_(rate, generator=g)) if rate > 0 else 0.0
    return out


def step_costs(model, batch: int, steps: int, repeats: int, prompt_len: int, kind: str | None) -> dict:
    """Per decode step at `batch` rows: medians of step, forward, scheduler (ms) and a plain batched step (ms)."""
    vocab = model.config.vocab_size
    own: list[float] = []
    fwd: list[float] = []

    def scheduled(tick):
        scheduler = Scheduler(model, SchedulerConfig(cache_kind=kind, max_tokens_per_step=batch * prompt_len),
                              clock=time.perf_counter)
        for r in make_requests(batch, vocab, (prompt_len, prompt_len), (steps + 2, steps + 2)):
            scheduler.submit(r)
        while not all(live.decoding for live in scheduler.running) or scheduler.waiting:
            scheduler.step()
        tick()
        for _ in range(steps):
            before, start = scheduler.forward_s, time.perf_counter()
            scheduler.step()
            total = time.perf_counter() - start
            fwd.append(scheduler.forward_s - before)
            own.append(total - fwd[-1])
            tick()

    def plain(tick):
        ids = torch.randint(3, vocab - 3, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
        ids = ids.to(model.device)
        state = DecodeState(make_cache(kind, model))
        with torch.inference_mode():
            logits, _ = state.prefill(model, ids, torch.ones_like(ids))
            live = torch.ones(batch, dtype=torch.long, device=model.device)
            tick()
            for _ in range(steps):
                logits = state.feed(model, logits.argmax(-1), live)
                logits.argmax(-1).tolist()
                tick()

    marks = time_interleaved({"scheduled": scheduled, "plain": plain}, repeats)
    own, fwd = own[steps:], fwd[steps:]  # the warm-up run's steps are not timed
    per_step = {name: statistics.median(b - a for m in runs for a, b in zip(m, m[1:])) for name, runs in marks.items()}
    return {"step_ms": 1e3 * per_step["scheduled"], "forward_ms": 1e3 * statistics.median(fwd),
            "scheduler_ms": 1e3 * statistics.median(own), "plain_ms": 1e3 * per_step["plain"]}


def throughput(model, requests: list[Request], repeats: int, max_running: int, max_wait_ms: float,
               kind: str | None) -> dict:
    """Output tokens/s (all requests' tokens over the makespan) of continuous vs static batching, same requests."""
    outputs: dict[str, list[list[int]]] = {}
    latency: dict[str, list[list[tuple[float, float]]]] = {"continuous": [], "static": []}  # per run: (TTFT, E2E)

    def run(name):
        def run_once(tick):
            start = time.perf_counter()

            def clock() -> float:
                return time.perf_counter() - start

            server = (Scheduler(model, SchedulerConfig(cache_kind=kind, max_running=max_running))
                      if name == "continuous" else
                      StaticBatcher(model, max_batch_size=max_running, max_wait_ms=max_wait_ms))
            records = drive(server, requests, clock, time.sleep)
            tick()
            outputs[name] = [r.output_ids for r in records]
            latency[name].append([(r.token_s[0] - r.arrival_s, r.token_s[-1] - r.arrival_s) for r in records])
        return run_once

    marks = time_interleaved({name: run(name) for name in ("continuous", "static")}, repeats)
    tokens = sum(r.max_new_tokens for r in requests)
    rates = {name: statistics.median(tokens / m[-1] for m in runs) for name, runs in marks.items()}
    timed = {name: [pair for run in runs[1:] for pair in run] for name, runs in latency.items()}  # no warm-up
    ttft = {name: statistics.median(a for a, _ in pairs) for name, pairs in timed.items()}
    e2e = {name: percentile([b for _, b in pairs], 90) for name, pairs in timed.items()}
    return {**rates, "ttft_s": ttft, "p90_e2e_s": e2e, "same": outputs["continuous"] == outputs["static"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (random, in-process) or a model id (zoo:smollm2-135m)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kind", default=None, help="cache kind (default: the model's dtype)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=50.0)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per s of the mixed load (0: all "
                        "at t=0)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    lm = load_model(config=TINY, seed=0, device="cpu") if args.model == "tiny" else load_model(
        args.model, dtype=args.dtype, device="cpu")
    model = lm.model
    print(f"model={args.model} dtype={args.dtype} kind={args.kind} threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'step ms':>8} {'forward':>8} {'sched ms':>8} {'sched %':>8} {'plain ms':>8} {'÷plain':>7}")
    for batch in args.batch:
        c = step_costs(model, batch, args.steps, args.repeats, args.prompt_len, args.kind)
        print(f"{batch:>5} {c['step_ms']:8.2f} {c['forward_ms']:8.2f} {c['scheduler_ms']:8.3f} "
              f"{100 * c['scheduler_ms'] / c['step_ms']:7.1f}% {c['plain_ms']:8.2f} "
              f"{c['step_ms'] / c['plain_ms']:7.2f}")
    requests = make_requests(args.requests, model.config.vocab_size, (8, 96), (8, 64), seed=1, rate=args.rate)
    t = throughput(model, requests, args.repeats, args.max_running, args.max_wait_ms, args.kind)
    print(f"mixed load: {args.requests} requests, {f'Poisson {args.rate:g}/s' if args.rate else 'all at t=0'}, "
          f"prompts 8-96, outputs 8-64 tokens, max_running={args.max_running}, static max_wait_ms="
          f"{args.max_wait_ms:g}")
    for name in ("continuous", "static"):
        print(f"  {name:>10} {t[name]:8.1f} tok/s   median TTFT {t['ttft_s'][name]:7.3f} s   p90 E2E "
              f"{t['p90_e2e_s'][name]:7.3f} s")
    print(f"  ratio {t['continuous'] / t['static']:.2f}   same tokens: {t['same']}")
    print(f"  (load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
