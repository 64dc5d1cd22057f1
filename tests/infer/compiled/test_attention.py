"""Attention for the compiled engine: the reduced (one column) and packed (grouped heads, no K/V copy) forms give
sdpa's result, and the model is switched to them only inside the block."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from runner.infer.compiled.attention import REDUCED_ATTENTION, attend_packed, attend_reduced, reduced_attention


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("boolean", [True, False])
def test_reduced_attention_of_one_column_equals_sdpa_to_float_rounding(kv_heads, boolean):
    """Grouped query heads, masked columns (boolean or additive), a bf16 query: sdpa's output within rounding."""
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, n, t, 24, generator=g) for n, t in ((4, 1), (kv_heads, 37), (kv_heads, 37)))
    allowed = torch.rand(2, 1, 1, 37, generator=g) > 0.3
    allowed[..., -1] = True
    mask = allowed if boolean else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=4 // kv_heads, is_causal=True)
    ours, _ = attend_reduced(module, query, key, value, mask, scaling=0.3)
    repeat = 4 // kv_heads
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(repeat, 1),
                                              value.repeat_interleave(repeat, 1),
                                              attn_mask=allowed, scale=0.3).transpose(1, 2)
    assert ours.shape == (2, 1, 4, 24) and torch.allclose(ours, expected, atol=1e-6)
    half, _ = attend_reduced(module, query.bfloat16(), key.bfloat16(), value.bfloat16(), mask, scaling=0.3)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), expected, atol=2e-2)


def test_reduced_attention_is_the_models_only_while_inside(tiny_lm):
    before = tiny_lm.model.config._attn_implementation
    with reduced_attention(tiny_lm.model):
        assert tiny_lm.model.model.layers[0].self_attn.config._attn_implementation == REDUCED_ATTENTION
    assert tiny_lm.model.config._attn_implementation == before


class _Module:
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("additive", [False, True])
def test_packed_queries_give_sdpa_s_attention(t, additive):
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, t, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    mask = torch.rand(2, 1, t, 16) > 0.3
    mask[..., 0] = True
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ours, _ = attend_packed(_Module(), query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (2, t, 6, 8)
    torch.testing.assert_close(ours, theirs)


def test_an_eager_prompt_forward_reads_only_the_columns_written(tiny_lm):
    """A prompt fed eagerly through a static cache of 256 columns attends to the columns written so far, not the
    whole cache: with every unwritten column NaN, its logits are the clean cache's, bit for bit (sdpa over masked NaN
    columns would give NaN), and so are the next feed's."""
    from runner.infer.compiled.engine import CompiledEngine

    ids = tiny_lm.tokenizer(["hello world, this is a prompt"], return_tensors="pt").input_ids  # [1,T]
    out = []
    for poison in (False, True):
        state = CompiledEngine(tiny_lm.model, compile=False).state("fp32", 1, 256, 256)
        with torch.inference_mode():
            for layer in state.cache.layers if poison else []:
                layer.keys.fill_(float("nan"))
                layer.values.fill_(float("nan"))
            first, _ = state.prefill(tiny_lm.model, ids, torch.ones_like(ids))  # [1,V]
            second = state.feed_row(tiny_lm.model, torch.tensor([5, 6]), keep=2)  # [2,V]
        out.append((first, second))
    assert torch.isfinite(out[1][0]).all() and torch.isfinite(out[1][1]).all()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
