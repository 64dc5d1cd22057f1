"""Packed grouped-query attention: transformers' sdpa result without copying K/V, and the model switched only inside
the block."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from runner.infer.packed_attention import NAME, packed, packed_sdpa


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
    ours, _ = packed_sdpa(_Module(), query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (2, t, 6, 8)
    torch.testing.assert_close(ours, theirs)


def test_the_model_is_switched_only_inside_the_block(tiny_lm):
    config = tiny_lm.model.config
    assert config._attn_implementation == "sdpa"
    with packed(tiny_lm.model):
        assert config._attn_implementation == NAME
    assert config._attn_implementation == "sdpa"
