"""The server's Prometheus metrics, through prometheus_client, in a registry of the server's own (several servers in
one process, as in tests, never share counts). Names follow vLLM's where one exists, with `runner_` for `vllm:`.

Latencies are the serve metrics' definitions (runner/infer/serve/metrics.py), from the request's arrival at the
HTTP layer: TTFT = first token − arrival, TPOT = (last − first) / (n − 1) (requests of ≥ 2 tokens), E2E = last
token − arrival; observed for requests that finished ok (eos, length, stop).
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runner.infer.serve.requests import RequestRecord

OUTCOMES = ("eos", "length", "stop", "cancelled", "refused", "error", "invalid", "unknown_model", "draining")
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
RATE_WINDOW_S = 10.0  # tokens/s: new tokens over the last this many seconds


class ServerMetrics:
    """Every metric of one server. The engine thread calls `finished`, `generated` and `state`; the HTTP layer
    `rejected` for what it refuses before the engine sees it."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("runner_requests", "Requests by outcome: the scheduler's finish (eos, length, stop, "
                                "cancelled, refused: queue full, error) or refused by the HTTP layer (invalid, "
                                "unknown_model, draining)", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every series exists from the start, at 0
        self.ttft = Histogram("runner_time_to_first_token_seconds", "Time to first token, from arrival",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("runner_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("runner_e2e_request_latency_seconds", "From arrival to the last token",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.running = Gauge("runner_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("runner_requests_waiting", "Requests in the waiting queue", registry=r)
        self.kv_blocks_used = Gauge("runner_kv_blocks_used", "KV blocks held by running requests", registry=r)
        self.kv_blocks_total = Gauge("runner_kv_blocks_total", "KV blocks in the budget", registry=r)
        self.kv_bytes = Gauge("runner_kv_bytes", "Bytes of KV storage allocated (the pool's, which grows up to the "
                              "budget; the compiled slots' static cache; KIVI requests' own caches)", registry=r)
        self.prompt_tokens = Counter("runner_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.prefix_queries = Counter("runner_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(each admission's prompt, of finished requests)", registry=r)
        self.prefix_hits = Counter("runner_prefix_cache_hits", "Of those, tokens served from the prefix cache "
                                   "(not prefilled)", registry=r)
        self.generation_tokens = Counter("runner_generation_tokens", "Output tokens generated", registry=r)
        self.tokens_per_s = Gauge("runner_generation_tokens_per_second",
                                  f"Output tokens per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self._recent: deque[tuple[float, int]] = deque()  # (t_s, new tokens) within the window
        self._start_s: float | None = None

    def rejected(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def finished(self, record: RequestRecord) -> None:
        self.requests.labels(record.finish).inc()
        if record.scheduled_s is not None:  # admitted 1 + preemptions times, each one a lookup
            self.prefix_queries.inc(record.prompt_tokens * (1 + record.preemptions))
            self.prefix_hits.inc(record.cached_prompt_tokens)
        if not record.ok or not record.token_s:
            return
        first, last, n = record.token_s[0], record.token_s[-1], len(record.token_s)
        self.ttft.observe(first - record.arrival_s)
        self.e2e.observe(last - record.arrival_s)
        if n > 1:
            self.tpot.observe((last - first) / (n - 1))

    def generated(self, tokens: int, now_s: float) -> None:
        if tokens > 0:
            self.generation_tokens.inc(tokens)
            self._recent.append((now_s, tokens))

    def state(self, running: int, waiting: int, blocks_used: int, kv_bytes: int, now_s: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_used.set(blocks_used)
        self.kv_bytes.set(kv_bytes)
        if self._start_s is None:
            self._start_s = now_s
        while self._recent and self._recent[0][0] < now_s - RATE_WINDOW_S:
            self._recent.popleft()
        span = min(RATE_WINDOW_S, now_s - self._start_s)
        self.tokens_per_s.set(sum(n for _, n in self._recent) / span if span > 0 else 0.0)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
