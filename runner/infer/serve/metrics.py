"""What a load's requests saw, summed up per point: latency percentiles, throughput, goodput against an SLO, and the
highest rate of a sweep that meets it, and a scheduler timeline's occupancy. Pure functions over RequestRecords;
torch-free.

Per request, from its *scheduled* arrival (`arrival_s`), as vLLM's `vllm bench serve` measures them:
  queue  scheduled_s - arrival_s (until it first joined the running batch)
  TTFT   token_s[0] - arrival_s
  TPOT   (token_s[-1] - token_s[0]) / (n - 1): the first token excluded; undefined for one token
  ITL    every token_s[i] - token_s[i-1]
  E2E    token_s[-1] - arrival_s
Only requests that finished ok count in the latencies. Percentiles interpolate linearly between the sorted values
(rank q/100 × (n - 1), numpy's default 'linear'). Throughputs divide by the span from the first arrival to the last
finish (a refusal finishes at its arrival).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from runner.infer.serve.requests import RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)
MS = 1000.0
LATENCIES = ("queue", "ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Slo:
    """Latency bounds in ms (None: unbounded), and the percentile a sweep point must meet them at."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    percentile: float = 90.0

    @property
    def bounds(self) -> dict[str, float]:
        return {name: bound for name, bound in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                                ("e2e", self.e2e_ms)) if bound is not None}


@dataclass(frozen=True)
class Latencies:
    """One request's latencies in seconds (see the module's docstring)."""

    queue_s: float | None
    ttft_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]
    e2e_s: float


def latencies(record: RequestRecord) -> Latencies | None:
    """The request's latencies; None when it did not finish ok or produced no token."""
    if not record.ok or not record.token_s:
        return None
    times, arrival = record.token_s, record.arrival_s
    n = len(times)
    return Latencies(queue_s=None if record.scheduled_s is None else record.scheduled_s - arrival,
                     ttft_s=times[0] - arrival,
                     tpot_s=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
                     itl_s=tuple(b - a for a, b in zip(times, times[1:])),
                     e2e_s=times[-1] - arrival)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_name(q: float) -> str:
    """p50, p99, p99.9: vLLM's spelling."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def meets(lat: Latencies, slo: Slo) -> bool:
    """Whether one request meets every bound of the SLO (a one-token request has no TPOT, and meets that bound)."""
    values = {"ttft": lat.ttft_s, "tpot": lat.tpot_s, "e2e": lat.e2e_s}
    return all((value := values[name]) is None or value * MS <= bound for name, bound in slo.bounds.items())


def span_s(records: Sequence[RequestRecord]) -> float:
    """From the first scheduled arrival to the last finish (last token; a failed request's arrival)."""
    starts = [r.arrival_s for r in records]
    ends = [r.token_s[-1] if r.ok and r.token_s else r.arrival_s for r in records]
    return max(ends) - min(starts) if records else 0.0


def summarize(records: Sequence[RequestRecord], percentiles: Iterable[float] = PERCENTILES,
              slo: Slo | None = None) -> dict[str, float]:
    """One point's metrics: counts, throughputs, goodput (when an SLO is given), and for each latency its mean and
    percentiles in ms (`mean_ttft_ms`, `p90_ttft_ms`, ...; NaN when no request has it); the SLO's percentile is
    always among them."""
    qs = sorted(set(percentiles) | ({slo.percentile} if slo is not None else set()))
    lats = [lat for r in records if (lat := latencies(r)) is not None]
    span = span_s(records)
    out: dict[str, float] = {
        "requests": len(records), "completed": len(lats),
        "refused": sum(r.finish == "refused" for r in records), "errors": sum(r.finish == "error" for r in records),
        "duration_s": span,
        "output_tokens": sum(len(r.token_s) for r in records if r.ok),
        "preemptions": sum(r.preemptions for r in records),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in records),
    }
    out["requests_per_s"] = out["completed"] / span if span > 0 else math.nan
    out["output_tokens_per_s"] = out["output_tokens"] / span if span > 0 else math.nan
    if slo is not None:
        out["good_requests"] = sum(meets(lat, slo) for lat in lats)
        out["goodput_per_s"] = out["good_requests"] / span if span > 0 else math.nan
    series = _series(lats)
    for name in LATENCIES:
        values_ms = [v * MS for v in series[name]]
        out[f"mean_{name}_ms"] = sum(values_ms) / len(values_ms) if values_ms else math.nan
        for q in qs:
            out[f"{percentile_name(q)}_{name}_ms"] = percentile(values_ms, q)
    return out


def occupancy(timeline: Sequence[tuple[float, int, int, int]]) -> dict[str, float]:
    """Mean and peak running requests and peak KV blocks used over a scheduler's steps (its `timeline` of
    (t_s, running, blocks_used, waiting)); {} for a server without one."""
    if not timeline:
        return {}
    running = [run for _, run, _, _ in timeline]
    return {"mean_running": sum(running) / len(running), "peak_running": max(running),
            "peak_blocks_used": max(used for _, _, used, _ in timeline)}


def _series(lats: list[Latencies]) -> dict[str, list[float]]:
    """Each latency's values over the requests (ITL: every gap of every request, pooled as vLLM pools them)."""
    return {"queue": [lat.queue_s for lat in lats if lat.queue_s is not None],
            "ttft": [lat.ttft_s for lat in lats],
            "tpot": [lat.tpot_s for lat in lats if lat.tpot_s is not None],
            "itl": [gap for lat in lats for gap in lat.itl_s],
            "e2e": [lat.e2e_s for lat in lats]}


def point_meets(summary: Mapping[str, float], slo: Slo) -> bool:
    """Whether a point meets the SLO, as vLLM's `serve_sla` criteria `p{q}_{metric}_ms <= bound`: every bounded
    latency's `slo.percentile` within its bound, at least one request completed, and none refused or failed (a
    refusal is an SLO miss that percentiles over finished requests would hide)."""
    if not summary.get("completed") or summary.get("refused") or summary.get("errors"):
        return False
    name = percentile_name(slo.percentile)
    for metric, bound in slo.bounds.items():
        value = summary.get(f"{name}_{metric}_ms", math.nan)
        if metric == "tpot" and math.isnan(value):
            continue  # every request gave one token: no TPOT to miss
        if math.isnan(value) or value > bound:
            return False
    return True


def max_rate_meeting(points: Mapping[float, Mapping[str, float]], slo: Slo) -> float | None:
    """The highest rate whose point meets the SLO (vLLM's `get_max_passing`: the largest passing value, even above a
    failing one), or None when none does. `points`: rate → its summary (computed at `slo.percentile`)."""
    passing = [rate for rate, summary in points.items() if point_meets(summary, slo)]
    return max(passing, default=None)
