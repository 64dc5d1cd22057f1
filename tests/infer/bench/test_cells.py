"""Bench cells on the tiny random model: both sides make the same cache, figures are consistent."""

import math

import pytest
import torch

from runner.infer.bench.cells import (
    MIB,
    Cell,
    Speculation,
    bandwidth_fraction,
    measure_hf,
    measure_hf_assisted,
    measure_ours,
    measure_speculative,
)
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache


@pytest.fixture(scope="module")
def ids(tiny_lm):
    return torch.randint(5, 200, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", [None, "q8_0", "kivi4"])
def test_ours_and_hf_leave_the_same_cache(tiny_lm, ids, kind):
    cell = Cell(6, kind, repeats=2, warmup=1, bandwidth=1e10)
    ours = measure_ours(tiny_lm.model, ids, cell)
    hf = measure_hf(tiny_lm.model, ids, cell)
    # both end with prompt + 5 tokens in the cache (the 6th token is decided, never fed back)
    cache = make_cache(kind, tiny_lm.model)
    with torch.inference_mode():
        tiny_lm.model(input_ids=torch.cat([ids, ids[:, :5]], dim=1), cache=cache, use_cache=True)
    assert ours["kv_mib"] == hf["kv_mib"] == cache_bytes(cache) / MIB
    for figures in (ours, hf):
        assert figures["tokens_per_s"] > 0 and figures["decode_tokens_per_s"] > 0
        assert figures["ttft_ms"] > 0 and figures["itl_ms"] > 0
        assert figures["itl_ms_p90"] >= figures["itl_ms"]
        assert 0 < figures["bw_fraction"] < 1
        assert figures["peak_mib"] > 0


def test_speculative_cells_report_acceptance(tiny_lm):
    repeating = torch.tensor([[7, 8, 9, 10] * 6])
    cell, lookup = Cell(8, None, repeats=2, warmup=0), Speculation("prompt-lookup", spec_k=3, adaptive=False)
    ours = measure_speculative(tiny_lm.model, repeating, cell, lookup)
    hf = measure_hf_assisted(tiny_lm.model, repeating, cell, lookup)
    assert ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0
    assert 0 <= ours["acceptance"] <= 1


def test_hf_assisted_generation_refuses_a_batch(tiny_lm, ids):
    with pytest.raises(ValueError, match="batch size 1"):
        measure_hf_assisted(tiny_lm.model, ids, Cell(4, None, repeats=1, warmup=0),
                            Speculation("prompt-lookup", spec_k=2))


def test_bandwidth_fraction_counts_weights_and_mid_decode_cache(tiny_lm):
    model = tiny_lm.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight.data_ptr() != embedding.data_ptr():
        weights -= embedding.numel() * embedding.element_size()
    # cache of 1200 bytes at 100 + 20 tokens → 1100 bytes at mid-decode (110 tokens)
    fraction = bandwidth_fraction(model, 1200, prompt_len=100, new_tokens=20, step_s=0.5, bandwidth=1e6)
    assert fraction == pytest.approx((weights + 1100) / 0.5 / 1e6)
    assert math.isnan(bandwidth_fraction(model, 1200, 100, 20, float("nan"), 1e6))
