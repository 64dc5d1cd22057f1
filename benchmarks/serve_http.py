"""What our HTTP server adds: the same seeded load served by our scheduler in this process (`mode: serve` without
HTTP) and by `run serve` in a subprocess, reached over loopback by RemoteServer (the serve block's `endpoints`).

    python benchmarks/serve_http.py                               # SmolLM2-135M fp32, Poisson 0.5 req/s
    python benchmarks/serve_http.py --rate 0.25 1 --requests 24 --repeats 3

Per rate: the two systems interleaved (runner.infer.measure.timing's harness: one untimed warm-up each, then
round-robin with the order reversed every other round); each repeat's p50 and mean TTFT and TPOT from the requests'
scheduled arrivals; medians over repeats and the ratio HTTP ÷ in-process. Target (issue 36): ≤ 1.10 TTFT and ≤ 1.05
TPOT at a rate below saturation. `same`: every request's greedy tokens equal between the two. The server process
and this one each have --threads torch threads; only one of them works at a time.

Measured (2026-11-26, 2-core AVX2 EPYC, load average < 1; SmolLM2-135M fp32, --rate 0.25 --requests 12 --repeats 3):
HTTP ÷ in-process p50 TTFT 0.965, p50 TPOT 1.023, output tok/s 0.992 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from runner.infer.loading.models import load_model  # noqa: E402
from runner.infer.loading.texts import load_text  # noqa: E402
from runner.infer.measure.timing import time_interleaved  # noqa: E402
from runner.infer.serve.driver import drive, load_clock  # noqa: E402
from runner.infer.serve.live import SchedulerConfig  # noqa: E402
from runner.infer.serve.load import Lengths, LoadSpec, build_load  # noqa: E402
from runner.infer.serve.metrics import summarize  # noqa: E402
from runner.infer.serve.remote import Endpoint, RemoteServer, launched  # noqa: E402
from runner.infer.serve.scheduler import Scheduler  # noqa: E402

MANIFEST = """name: serve-http
targets:
  - name: bench
    model: {{id: {model}, dtype: {dtype}, device: cpu}}
    runs:
      - id: http
        mode: serve
        serve: {{rate: 1, max_batch_size: {batch}, baselines: [none]}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="zoo:smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rate", type=float, nargs="+", default=[0.5])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device="cpu")
    text = load_text("pydoc").text
    config = SchedulerConfig(max_running=args.batch)
    port = free_port()
    endpoint = Endpoint("http", f"http://127.0.0.1:{port}", args.model)  # run serve names it by its model id
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "serve_http.yaml"
        manifest.write_text(MANIFEST.format(model=args.model, dtype=args.dtype, batch=args.batch))
        env_threads = {"OMP_NUM_THREADS": str(args.threads)}
        os.environ.update(env_threads)
        command = [sys.executable, "-m", "runner", "serve", str(manifest), "--port", str(port)]
        print(f"# starting: {' '.join(command)}", flush=True)
        with launched(command, endpoint, Path(tmp) / "server.log", timeout_s=600):
            for rate in args.rate:
                spec = LoadSpec(rate=rate, num_requests=args.requests, prompt_tokens=Lengths(value=args.prompt),
                                output_tokens=Lengths(value=args.output))
                measure(rate, lm, endpoint, config, build_load(spec, lm.tokenizer, text).requests, args.repeats)


def measure(rate: float, lm, endpoint: Endpoint, config: SchedulerConfig, requests, repeats: int) -> None:
    summaries: dict[str, list[dict]] = {"in-process": [], "http": []}
    outputs: dict[str, list[list[int]]] = {}

    def variant(name: str):
        def run_once(tick) -> None:
            server = (Scheduler(lm.model, config, tokenizer=lm.tokenizer) if name == "in-process"
                      else RemoteServer(endpoint, lm.tokenizer, seed=0))
            try:
                records = drive(server, requests, load_clock(), time.sleep)
            finally:
                if isinstance(server, RemoteServer):
                    server.close()
            tick()
            summaries[name].append(summarize(records, (50,)))
            outputs[name] = [r.output_ids for r in records]
        return run_once

    time_interleaved({name: variant(name) for name in summaries}, repeats=repeats)
    timed = {name: rows[1:] for name, rows in summaries.items()}  # the first of each is the untimed warm-up
    same = sum(a == b for a, b in zip(outputs["in-process"], outputs["http"]))
    print(f"\nrate {rate:g} req/s, {len(requests)} requests, medians of {repeats} (warm-up excluded):")
    print(f"{'metric':<16}{'in-process':>12}{'http':>12}{'ratio':>8}")
    for metric in ("p50_ttft_ms", "mean_ttft_ms", "p50_tpot_ms", "mean_tpot_ms", "output_tokens_per_s"):
        a, b = (statistics.median(row[metric] for row in timed[name]) for name in ("in-process", "http"))
        print(f"{metric:<16}{a:>12.1f}{b:>12.1f}{b / a:>8.3f}")
    print(f"same greedy tokens: {same}/{len(requests)}; completed http: "
          f"{[int(row['completed']) for row in timed['http']]}")


if __name__ == "__main__":
    main()
