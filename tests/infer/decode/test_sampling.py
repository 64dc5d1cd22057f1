"""Our filters against transformers' logits processors on random logits, and the sampler's statistics."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.sampling import (
    apply_min_p,
    apply_no_repeat_ngram,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical,
    next_token,
    process_logits,
    sample,
)


@pytest.fixture
def logits():
    return torch.randn(4, 100, generator=torch.Generator().manual_seed(0)) * 3


@pytest.fixture
def seen():
    return torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(logits, seen, penalty):
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, penalty), expected)


@pytest.mark.parametrize("temperature", [0.3, 0.8, 1.7])
def test_temperature_matches_transformers(logits, seen, temperature):
    expected = TemperatureLogitsWarper(temperature)(seen, logits.clone())
    assert torch.allclose(apply_temperature(logits, temperature), expected)


@pytest.mark.parametrize("k", [1, 5, 50, 99])
def test_top_k_matches_transformers(logits, seen, k):
    expected = TopKLogitsWarper(k)(seen, logits.clone())
    assert torch.equal(apply_top_k(logits, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(logits, seen, p):
    expected = TopPLogitsWarper(p)(seen, logits.clone())
    assert torch.equal(apply_top_p(logits, p), expected)


def test_full_chain_matches_transformers_order(logits, seen):
    cfg = GenerateConfig(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.2)
    expected = logits.clone()
    for proc in [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                 TopPLogitsWarper(0.8)]:
        expected = proc(seen, expected)
    assert torch.allclose(process_logits(logits, seen, cfg), expected)


def test_filters_off_leave_logits_unchanged(logits):
    assert torch.equal(apply_top_k(logits, None), logits)
    assert torch.equal(apply_top_k(logits, 0), logits)
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_greedy_is_argmax(logits, seen):
    assert torch.equal(next_token(logits, seen, GenerateConfig(temperature=0), None), logits.argmax(-1))


def test_sample_frequencies_match_softmax():
    """20,000 draws from a 5-way distribution: every frequency within 5 standard errors (p_fail < 1e-5)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    n = 20_000
    draws = sample(logits.expand(n, -1), torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=5).float() / n
    stderr = (probs * (1 - probs) / n).sqrt()
    assert torch.all((freq - probs).abs() < 5 * stderr), (freq, probs)


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4)).expand(5000, -1)
    cfg = GenerateConfig(temperature=1.0, top_k=3)
    draws = next_token(logits, logits.new_zeros(5000, 1, dtype=torch.long), cfg, torch.Generator().manual_seed(5))
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    assert set(draws.tolist()) == allowed  # all three appear in 5000 draws, nothing else does


def test_same_generator_seed_same_samples(logits):
    a = sample(logits, torch.Generator().manual_seed(9))
    b = sample(logits, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_matches_transformers(logits, seen, min_p):
    expected = MinPLogitsWarper(min_p)(seen, logits.clone())
    assert torch.equal(apply_min_p(logits, min_p), expected)


@pytest.mark.parametrize("mass", [0.05, 0.3, 0.7, 0.95])
def test_typical_matches_transformers(logits, seen, mass):
    expected = TypicalLogitsWarper(mass)(seen, logits.clone())
    assert torch.equal(apply_typical(logits, mass), expected)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(size):
    """Few token values so that repeated n-grams really occur (and token 0 is among the banned ones)."""
    scores = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 5, (6, 20), generator=torch.Generator().manual_seed(3))
    expected = NoRepeatNGramLogitsProcessor(size)(ids, scores.clone())
    ours = apply_no_repeat_ngram(scores, ids, size)
    assert torch.isinf(expected).any() and torch.equal(ours, expected)
    assert torch.equal(apply_no_repeat_ngram(scores, ids[:, : size - 1], size), scores)  # no full n-gram yet


def test_min_p_sampling_stays_above_the_threshold():
    """4000 draws with min_p 0.2: nothing below 0.2 × the top probability is ever drawn, everything above is."""
    logits = torch.tensor([[3.0, 2.5, 1.8, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    draws = next_token(logits.expand(4000, -1), logits.new_zeros(4000, 1, dtype=torch.long),
                       GenerateConfig(temperature=1.0, min_p=0.2), torch.Generator().manual_seed(6))
    assert set(draws.tolist()) == allowed and len(allowed) < 6


def test_full_chain_with_new_filters_matches_transformers(logits, seen):
    cfg = GenerateConfig(temperature=0.9, top_k=60, top_p=0.95, min_p=0.02, typical_p=0.9, repetition_penalty=1.1,
                         no_repeat_ngram_size=2)
    expected = logits.clone()
    for proc in [RepetitionPenaltyLogitsProcessor(1.1), NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.9),
                 TopKLogitsWarper(60), TopPLogitsWarper(0.95), MinPLogitsWarper(0.02), TypicalLogitsWarper(0.9)]:
        expected = proc(seen, expected)
    assert torch.allclose(process_logits(logits, seen, cfg), expected)
