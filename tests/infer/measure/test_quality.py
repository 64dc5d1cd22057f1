"""Quality metrics: teacher-forced decode through a cache agrees with one full forward; KL's direction."""

import math

import pytest
import torch

from runner.infer.cache.registry import make_cache
from runner.infer.loading.texts import load_text
from runner.infer.measure.quality import (
    build_probe,
    chunked_nll,
    compare,
    kl_divergence,
    run_probe,
    teacher_forced_logprobs,
)


@pytest.fixture(scope="module")
def probe(tiny_lm):
    return build_probe(tiny_lm.tokenizer, load_text("pydoc"), prompt_len=12, decode_steps=3, windows=3, ppl_len=200,
                       device=torch.device("cpu"))


@torch.no_grad()
def _full_forward_logprobs(model, ids):
    return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


def test_teacher_forced_decode_equals_one_full_forward(tiny_lm, probe):
    ids, P = probe.windows, probe.prompt_len
    decoded = teacher_forced_logprobs(tiny_lm.model, ids, P, None, score_prefill=True)  # predicts ids[P:]
    full = _full_forward_logprobs(tiny_lm.model, ids)[:, P - 1:-1]
    assert decoded.shape == full.shape == (ids.shape[0], ids.shape[1] - P, full.shape[-1])
    torch.testing.assert_close(decoded, full, atol=1e-4, rtol=1e-4)
    without_prefill = teacher_forced_logprobs(tiny_lm.model, ids, P, None, score_prefill=False)
    torch.testing.assert_close(without_prefill, decoded[:, 1:])


def test_chunked_perplexity_equals_one_full_forward(tiny_lm, probe):
    ids = probe.ppl_ids  # 200 tokens: two chunks of 128 and 72
    full = _full_forward_logprobs(tiny_lm.model, ids)
    expected = float(-full[:, :-1].gather(-1, ids[:, 1:, None]).mean())
    assert chunked_nll(tiny_lm.model, ids, make_cache(None, tiny_lm.model)) == pytest.approx(expected, abs=1e-4)


def test_kl_is_reference_to_candidate_and_matches_torch():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0]]), dim=-1)
    cand = torch.log_softmax(torch.tensor([[0.0, 1.0, 0.5]]), dim=-1)
    expected = torch.nn.functional.kl_div(cand, ref, log_target=True, reduction="sum")  # KL(ref ‖ cand)
    assert float(kl_divergence(ref, cand)) == pytest.approx(float(expected), rel=1e-6)
    assert float(kl_divergence(ref, cand)) != pytest.approx(float(kl_divergence(cand, ref)), rel=1e-3)
    assert float(kl_divergence(ref, ref)) == 0.0


def test_the_models_own_dtype_is_an_exact_reference(tiny_lm, probe):
    metrics = compare(run_probe(tiny_lm.model, probe, None), run_probe(tiny_lm.model, probe, "fp32"))
    assert metrics["delta_nll"] == 0.0 and metrics["ppl_ratio"] == 1.0 and metrics["mean_kl"] == 0.0


def test_a_4_bit_cache_moves_every_metric(tiny_lm, probe):
    """The probe really reads K/V back from the cache: 4-bit storage changes what the model predicts."""
    reference = run_probe(tiny_lm.model, probe, None)
    metrics = compare(reference, run_probe(tiny_lm.model, probe, "q4_0"))
    assert metrics["mean_kl"] > 1e-6 and metrics["needle_kl"] > 1e-6
    assert metrics["delta_nll"] != 0.0 and metrics["ppl_ratio"] != 1.0
    assert math.isfinite(metrics["ppl"]) and metrics["measured_bytes_per_token"] < reference.bytes_per_token / 3
