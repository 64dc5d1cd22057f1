"""The metrics of a point on a hand-made trace, every number worked out by hand in the comments; percentiles as
numpy's default; the SLO criteria of a sweep point and the highest rate meeting them."""

import math
import random

import numpy as np
import pytest

from runner.infer.serve.metrics import Slo, latencies, max_rate_meeting, occupancy, percentile, point_meets, summarize
from runner.infer.serve.requests import RequestRecord

TRACE = [
    # A: queue 0.1; TTFT 0.5; TPOT (1.1 - 0.5) / 3 = 0.2; ITL 0.2, 0.2, 0.2; E2E 1.1
    RequestRecord(0, 0.0, 10, scheduled_s=0.1, token_s=[0.5, 0.7, 0.9, 1.1], output_ids=[1, 2, 3, 4], finish="length"),
    # B: queue 0; TTFT 0.2; TPOT (0.5 - 0.4) / 1 = 0.1; ITL 0.1; E2E 0.3
    RequestRecord(1, 0.2, 10, scheduled_s=0.2, token_s=[0.4, 0.5], output_ids=[1, 2], finish="eos"),
    # C: queue 0.5; TTFT 1.0; one token: no TPOT, no ITL; E2E 1.0
    RequestRecord(2, 0.5, 10, scheduled_s=1.0, token_s=[1.5], output_ids=[1], finish="stop"),
    # D: refused at its arrival, 1.0
    RequestRecord(3, 1.0, 10, finish="refused"),
    # E: failed after three tokens: in no latency and no throughput; it ends (for the span) at its arrival, 1.2
    RequestRecord(4, 1.2, 10, scheduled_s=1.3, token_s=[1.6, 2.0, 2.4], output_ids=[1, 2, 3], finish="error",
                  preemptions=2, cached_prompt_tokens=4),
]


def test_each_requests_latencies_are_measured_from_its_scheduled_arrival():
    a = latencies(TRACE[0])
    assert a is not None and a.queue_s == pytest.approx(0.1) and a.ttft_s == 0.5 and a.e2e_s == 1.1
    assert a.tpot_s == pytest.approx(0.2) and a.itl_s == pytest.approx((0.2, 0.2, 0.2))
    c = latencies(TRACE[2])
    assert c is not None and c.tpot_s is None and c.itl_s == ()
    assert latencies(TRACE[3]) is None and latencies(TRACE[4]) is None


def test_a_points_metrics_on_the_hand_made_trace():
    s = summarize(TRACE)
    # counts: 5 requests; A, B, C completed; D refused; E failed
    assert (s["requests"], s["completed"], s["refused"], s["errors"]) == (5, 3, 1, 1)
    assert (s["preemptions"], s["cached_prompt_tokens"]) == (2, 4)
    # span: first arrival 0.0 → last finish max(A 1.1, B 0.5, C 1.5, D 1.0, E 1.2) = 1.5 s
    assert s["duration_s"] == 1.5
    # throughput: 3 completed / 1.5 s = 2.0 req/s; output tokens 4 + 2 + 1 = 7 / 1.5 s = 4.667 tok/s
    assert s["requests_per_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 7 and s["output_tokens_per_s"] == pytest.approx(7 / 1.5)
    # TTFT ms sorted [200, 500, 1000]: mean 566.67; p50 rank 1 → 500; p90 rank 1.8 → 500 + 0.8 × 500 = 900;
    # p99 rank 1.98 → 500 + 0.98 × 500 = 990
    assert s["mean_ttft_ms"] == pytest.approx(1700 / 3)
    assert (s["p50_ttft_ms"], s["p90_ttft_ms"], s["p99_ttft_ms"]) == pytest.approx((500, 900, 990))
    # TPOT ms [100, 200] (C has none): mean 150; p50 rank 0.5 → 150; p90 rank 0.9 → 190; p99 → 199
    assert (s["mean_tpot_ms"], s["p50_tpot_ms"], s["p90_tpot_ms"], s["p99_tpot_ms"]) == \
        pytest.approx((150, 150, 190, 199))
    # ITL ms, every gap pooled: [100, 200, 200, 200]: mean 175; p50 rank 1.5 → 200
    assert (s["mean_itl_ms"], s["p50_itl_ms"]) == pytest.approx((175, 200))
    # E2E ms [300, 1000, 1100]: mean 800; p50 1000; p90 rank 1.8 → 1000 + 0.8 × 100 = 1080; p99 → 1098
    assert (s["mean_e2e_ms"], s["p50_e2e_ms"], s["p90_e2e_ms"], s["p99_e2e_ms"]) == \
        pytest.approx((800, 1000, 1080, 1098))
    # queue ms [0, 100, 500]: mean 200; p50 100; p90 rank 1.8 → 100 + 0.8 × 400 = 420
    assert (s["mean_queue_ms"], s["p50_queue_ms"], s["p90_queue_ms"]) == pytest.approx((200, 100, 420))
    assert "goodput_per_s" not in s


@pytest.mark.parametrize("slo, good", [
    # A misses TPOT (200 > 150), B meets both (200, 100), C misses TTFT (1000 > 600): 1 good
    (Slo(ttft_ms=600, tpot_ms=150), 1),
    # A misses (1100 > 1000); B (300) and C (1000 ≤ 1000: a bound is inclusive, as vLLM's) meet: 2 good
    (Slo(e2e_ms=1000), 2),
    # A (200) and B (100) miss; C has no TPOT, so it meets that bound: 1 good
    (Slo(tpot_ms=50), 1),
    # no bound: every completed request is good: 3 (D refused and E failed never are)
    (Slo(), 3),
])
def test_goodput_counts_the_completed_requests_meeting_every_bound(slo, good):
    s = summarize(TRACE, slo=slo)
    assert s["good_requests"] == good and s["goodput_per_s"] == pytest.approx(good / 1.5)


def test_percentiles_are_numpys_linear_default_and_the_slos_percentile_is_always_reported():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 0.1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    s = summarize(TRACE, percentiles=[99.9], slo=Slo(ttft_ms=1, percentile=75))
    assert {"p99.9_ttft_ms", "p75_ttft_ms"} <= set(s) and "p50_ttft_ms" not in s
    assert s["p75_ttft_ms"] == pytest.approx(750)  # [200, 500, 1000] rank 1.5 → 500 + 0.5 × 500


def point(p90_ttft_ms, refused=0, errors=0, completed=10, p90_tpot_ms=10.0):
    return {"completed": completed, "refused": refused, "errors": errors, "p90_ttft_ms": p90_ttft_ms,
            "p90_tpot_ms": p90_tpot_ms}


def test_a_point_meets_the_slo_at_its_percentile_with_nothing_refused():
    slo = Slo(ttft_ms=600, tpot_ms=20)
    assert point_meets(point(600), slo) and not point_meets(point(601), slo)
    assert not point_meets(point(100, p90_tpot_ms=21), slo)
    assert not point_meets(point(100, refused=1), slo), "a refusal is a miss the percentiles would hide"
    assert not point_meets(point(100, errors=1), slo) and not point_meets(point(100, completed=0), slo)
    assert point_meets(point(100, p90_tpot_ms=math.nan), slo), "every request one token: no TPOT to miss"
    assert not point_meets(point(math.nan), slo)


def test_the_highest_rate_meeting_the_slo_is_the_largest_passing_point():
    slo = Slo(ttft_ms=600)
    # 1 and 2 pass, 4 misses (900 ms), 8 passes again (noise), 16 refuses some: vLLM's max passing value → 8
    points = {1.0: point(300), 2.0: point(500), 4.0: point(900), 8.0: point(550), 16.0: point(200, refused=3)}
    assert max_rate_meeting(points, slo) == 8.0
    assert max_rate_meeting({1.0: point(700)}, slo) is None
    assert max_rate_meeting({r: summarize(TRACE[:3], slo=slo) for r in (0.5,)}, slo) is None  # p90 TTFT 900
    assert max_rate_meeting({0.5: summarize(TRACE[:2], slo=slo)}, slo) == 0.5  # p90 TTFT 200 + 0.9 × 300 = 470


def test_occupancy_of_a_hand_made_timeline():
    """(t_s, running, blocks_used, waiting) per step → mean and peak running, peak blocks; nothing without steps."""
    timeline = [(0.0, 1, 4, 2), (0.1, 3, 9, 0), (0.2, 2, 7, 0)]
    assert occupancy(timeline) == {"mean_running": 2.0, "peak_running": 3, "peak_blocks_used": 9}
    assert occupancy([]) == {}
