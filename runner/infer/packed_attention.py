"""Grouped-query attention for the compiled step without copying the cache: queries packed onto their KV heads.

transformers' sdpa path packs the G = heads / KV heads queries of one token onto their KV head only when it is not
being compiled (`pack_gqa`); under torch.compile it calls `repeat_kv`, which copies every layer's whole K and V to
G× the heads at every step ([B,H,S,D] → [B,G·H,S,D], then read again by the attention kernel). Over a static cache
of S columns that copy grows with S, not with the tokens written: at S = 256 it is about a sixth of a bfloat16
step's memory traffic for SmolLM2-135M (G = 3). Here the G query heads of a KV head become G·T query rows of it,
[B,G·H,T,D] → [B,H,G·T,D], and the mask [B,1,T,S] is repeated G times along its rows: the same attention of every
(head, token) row, the cache read once and never copied.

`packed(model)` switches the model to it for the duration of a call (the compiled engine's steps); the model's own
setting is restored after, so eager forwards, transformers' baselines and other engines are untouched. Only a
model on "sdpa" is switched. Owns: the attention function and its registration. Does not know about caches or
compilation.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "runner_packed_sdpa"


def packed_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """query [B,G·H,T,D], key/value [B,H,S,D], mask [B,1,T,S] (bool or additive) → ([B,T,G·H,D], None), as
    transformers' sdpa_attention_forward returns; what this does not cover (no grouping, a per-head mask, a
    position bias, softcap) goes to that function."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or attention_mask.shape[1] != 1
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, heads, t, d = query.shape
    rows = query.reshape(b, key.shape[1], groups * t, d)  # [B,H,G·T,D]: head h·G+g, token t → row g·T+t of KV head h
    mask = attention_mask.repeat(1, 1, groups, 1)  # [B,1,G·T,S]
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextmanager
def packed(model):
    """The model attends with `packed_sdpa` inside the block when it is on "sdpa" (else unchanged)."""
    config = model.config
    before = config._attn_implementation_internal
    if before != "sdpa":
        yield
        return
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = before
