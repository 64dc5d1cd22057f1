"""Attention for the compiled engine's static forwards: grouped-query heads read the cache in place.

transformers' sdpa path packs the G = heads / KV heads queries of a token onto their KV head only when it is not
being compiled; under torch.compile it calls `repeat_kv`, which copies every layer's whole K and V to G× the heads
at every step. Over a static cache of S columns that copy grows with S, not with the tokens written, and came to
several times the attention itself. Two forms, neither copying:
    attend_reduced  one new column. On CPU, when the compiled step hands its static cache over (keyword
                    STATIC_CACHE) and cpu_attention's kernel is built: the layer's `attend`, which reads the
                    cache in its stored format (each column decoded once for the G query heads of its KV head).
                    Else scores and output as sums of products over the K/V the cache hands it (any
                    elementwise expression of its codes), so inductor fuses a quantized cache's dequantization into
                    those reductions instead of building the full float K/V; head_dim is summed in chunks of
                    quant.PLANE values, the width of a packed cache's planes (`_chunked`)
    attend_packed   more columns (prefill pieces, speculative verification): the G query heads of a KV head become
                    G·T query rows of it for sdpa, the mask repeated G times along its rows
`reduced_attention(model)` switches the model to them for the duration of a call (the compiled engine's steps) and
restores its own setting after, so eager forwards and transformers' baselines are untouched. Knows of caches only
the chunk width their codes are packed in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from runner.infer.kernels import cpu_attention
from runner.infer.quant.formats import PLANE

REDUCED_ATTENTION = "runner_reduced"
STATIC_CACHE = "runner_static_cache"  # the keyword the compiled step hands its cache to attention by


def attend_reduced(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs):
    """transformers' attention signature. One query column ([B,Hq,1,D] query; [B,Hkv,S,D] key and value, any
    elementwise expression of the cache; [B,1,1,S] boolean or additive mask) → ([B,1,Hq,Dv], None) in float32
    arithmetic, query heads grouped over their KV head (no copy of K/V per query head). The sums run in another
    order than sdpa's, so results agree to float rounding, not bit for bit. Longer queries: `attend_packed`."""
    if query.shape[2] != 1:
        return attend_packed(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, heads, _, dim = query.shape
    scaling = dim**-0.5 if scaling is None else scaling
    layer = static_layer(module, kwargs.get(STATIC_CACHE), query)
    if layer is not None and attention_mask is not None and attention_mask.dtype == torch.bool:
        return layer.attend(query, attention_mask[:, 0, -1], scaling, kwargs[STATIC_CACHE].columns,
                            kwargs[STATIC_CACHE].end), None
    if key.shape[2] == 0:
        raise RuntimeError("a static cache handed attention no K/V for the kernel to read, but the kernel cannot "
                           "read this layer here (StaticKVCache.code_blocks(views=False) without kernel_attends)")
    kv_heads, columns, value_dim = key.shape[1], key.shape[2], value.shape[-1]
    rows = _materialized(query.reshape(b * heads, dim).float())  # [B·Hq,D]
    grouped = _chunked(rows.reshape(b, kv_heads, heads // kv_heads, 1, dim))  # [B,Hkv,G,1,D/C,C]
    scores = (grouped * _chunked(key[:, :, None].float())).sum((-2, -1)) * scaling  # [B,Hkv,G,S]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1, -columns:].reshape(attention_mask.shape[0], 1, 1, columns)  # [B|1,1,1,S]
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.float())
    probs = scores.softmax(-1)  # [B,Hkv,G,S]
    chunks = _chunked(value[:, :, None].float())  # [B,Hkv,1,S,Dv/C,C]
    out = (probs[..., None, None] * chunks).sum(-3)  # [B,Hkv,G,Dv/C,C]
    return out.reshape(b, 1, heads, value_dim).to(query.dtype), None


def static_layer(module, cache, query: torch.Tensor):
    """The static cache layer `module` reads, when cpu_attention's kernel can read it in its stored format (on
    CPU, the kernel built, a layer whose decoded values need no rounding to the query's dtype); else None."""
    if cache is None or query.device.type != "cpu" or not cpu_attention.ready():
        return None
    layer = cache.layers[module.layer_idx]
    return layer if hasattr(layer, "kernel_reads") and layer.kernel_reads(query.dtype) else None


def _materialized(rows: torch.Tensor) -> torch.Tensor:
    """rows [N,D] as a buffer of their own: their product with the identity, an extern matmul (exact in float32).
    Left as an expression, the query's rotary embedding (cos and sin of position × frequency) is inlined by inductor
    into the scores loop and computed again for each of the S columns."""
    return rows @ torch.eye(rows.shape[-1], dtype=rows.dtype, device=rows.device)


def _chunked(x: torch.Tensor) -> torch.Tensor:
    """[..., D] → [..., D/C, C], C = quant.PLANE (D a multiple of it; else [..., 1, D]): a packed cache's codes lie
    in planes of C bytes, so reductions over (D/C, C) read C bytes at a time under one shift, where a sum over D
    alone makes inductor gather the bytes of each value one by one. For float K/V inductor merges them back."""
    chunk = PLANE if x.shape[-1] % PLANE == 0 else x.shape[-1]
    return x.unflatten(-1, (-1, chunk))


AttentionInterface.register(REDUCED_ATTENTION, attend_reduced)


@contextmanager
def reduced_attention(model):
    """While inside, `model` attends with `attend_reduced` (its config's attention implementation swapped, then
    restored): the compiled engine's static forwards, so eager forwards of the same model keep theirs."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = REDUCED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def attend_packed(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """query [B,G·H,T,D], key/value [B,H,S,D], mask [B,1,T,S'] (bool or additive; S' ≤ S: an eager forward's mask
    stops at the columns written, and the cache's columns past it are not read) → ([B,T,G·H,D], None), as
    transformers' sdpa_attention_forward returns; what this does not cover (no grouping, a per-head mask, a
    position bias, softcap) goes to that function."""
    if attention_mask is not None and key.shape[2] > attention_mask.shape[-1]:  # the columns past it are unwritten
        key, value = key[:, :, :attention_mask.shape[-1]], value[:, :, :attention_mask.shape[-1]]
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or attention_mask.shape[1] != 1
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    assert attention_mask is not None  # `plain` when there is none
    b, heads, t, d = query.shape
    rows = query.reshape(b, key.shape[1], groups * t, d)  # [B,H,G·T,D]: head h·G+g, token t → row g·T+t of KV head h
    mask = attention_mask.repeat(1, 1, groups, 1)  # [B,1,G·T,S]
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2).contiguous(), None
