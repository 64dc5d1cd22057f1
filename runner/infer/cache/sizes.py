"""The bytes a cache of each kind holds, computed from a model config and its KindOptions: the estimators the
registry names, one per family, which must agree with the layers' measured bytes (`layers.cache_bytes`).

Per token per head at head_dim 64, against fp16's 2·64·2 = 256 bytes (K and V):
    q8_0 136 (0.53×), q4_0 / nf4 72 (0.28×), q4_1 80 (0.31×),
    kivi4 g32: keys 64·4/8 + 2·2·64/32 = 40, values 64·4/8 + 2·2·2 = 40 → 80 (0.3125×),
    kivi3 g32: keys 24 + 8, values 24 + 8 → 64 (0.25×); g64: keys 24 + 4 → 60 (0.234×),
    kivi2 g32: keys 16 + 8 = 24, values 16 + 8 = 24 → 48 (0.1875×);
    o1 at g64: 41 outliers per side per 64 tokens × (2 + 2 bytes) → + 5.125 (0.020×).
Owns `dims`, the estimators (`FloatSizes`, `BlockSizes`, `KiviSizes`) and transformers' own cache's bytes
(`native_bytes`). Knows nothing of layer classes: the registry pairs each kind with its estimator.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from runner.infer.config.kinds import KindOptions, torch_dtype
from runner.infer.quant.formats import head_bytes
from runner.infer.quant.kivi_math import index_dtype, outlier_count

Dims = tuple[int, int, int]  # (layers, KV heads, head_dim)


def dims(config) -> Dims:
    """(layers, KV heads, head_dim) of a llama-style model config."""
    text = config.get_text_config(decoder=True)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def float_per_token(shape: Dims, dtype: torch.dtype) -> int:
    """Bytes one token adds to K/V stored in `dtype`, over all layers."""
    layers, kv_heads, head_dim = shape
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def native_bytes(config, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
    """Bytes of transformers' DynamicCache (the model's own dtype): a sliding-window layer keeps its last
    window − 1 tokens, a layer that reuses another's cache none. Our own kinds keep every token in every layer."""
    _, kv_heads, head_dim = dims(config)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    tokens = sum(0 if kind == "dummy" else min(seq_len, kwargs["sliding_window"] - 1) if "sliding_window" in kwargs
                 else seq_len for kind, kwargs in zip(layer_types, layer_kwargs))
    return batch * tokens * kv_heads * 2 * head_dim * model_dtype.itemsize


class Sizes:
    """An estimator: bytes a layer of a kind holds. The base: every token stored alike, nothing kept apart."""

    @staticmethod
    def per_token(options: KindOptions, shape: Dims, model_dtype: torch.dtype) -> int | float:
        """Compressed bytes one token of one sequence adds, over all layers, K and V."""
        raise NotImplementedError

    @staticmethod
    def residual(options: KindOptions, shape: Dims, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
        """Bytes held in full precision apart from the compressed tokens (KIVI's residual); 0 here."""
        return 0

    @classmethod
    def held(cls, options: KindOptions, shape: Dims, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
        """Bytes a cache of the kind holds at `batch` × `seq_len` tokens."""
        per_token = cls.per_token(options, shape, model_dtype)
        assert isinstance(per_token, int), f"{cls.__name__} stores fractions of bytes per token: it overrides held"
        return batch * seq_len * per_token


class FloatSizes(Sizes):
    """fp32 / fp16 / bf16: K/V as they are, in the kind's dtype."""

    @staticmethod
    def per_token(options: KindOptions, shape: Dims, model_dtype: torch.dtype) -> int:
        return float_per_token(shape, torch_dtype(options.name))


class BlockSizes(Sizes):
    """q8_0 / q4_0 / q4_1 / nf4: whole blocks of codes along head_dim and their scales (quant.formats.head_bytes)."""

    @staticmethod
    def per_token(options: KindOptions, shape: Dims, model_dtype: torch.dtype) -> int:
        layers, kv_heads, head_dim = shape
        return 2 * layers * kv_heads * head_bytes(options.name, head_dim)


class KiviSizes(Sizes):
    """KIVI (layers.KiviLayer): sinks in the model's dtype, quantized groups with their outliers, the residual in
    the model's dtype, and the fitted codebooks (nuq) once per layer while it holds tokens. `per_token` leaves out
    the residual and the fixed costs (sinks, codebooks); a float when g does not divide the group's bytes."""

    @staticmethod
    def per_token(options: KindOptions, shape: Dims, model_dtype: torch.dtype) -> int | float:
        layers, kv_heads, head_dim = shape
        group = options.kivi.group_size
        per_group = layers * kv_heads * (_kivi_head_bytes(options, head_dim, group)
                                         + _outlier_chunk_bytes(options, head_dim))
        return per_group // group if per_group % group == 0 else per_group / group

    @staticmethod
    def residual(options: KindOptions, shape: Dims, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
        """The (seq_len − sinks) mod residual_len newest tokens; sinks are not in it: they stay forever."""
        layers, kv_heads, head_dim = shape
        return batch * layers * kv_heads * 2 * head_dim * kivi_split(options, seq_len)[2] * model_dtype.itemsize

    @classmethod
    def held(cls, options: KindOptions, shape: Dims, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
        layers, kv_heads, head_dim = shape
        kivi = options.kivi
        sinks, quantized, _ = kivi_split(options, seq_len)
        compressed = (_kivi_head_bytes(options, head_dim, quantized) + sinks * 2 * head_dim * model_dtype.itemsize
                      + quantized // kivi.group_size * _outlier_chunk_bytes(options, head_dim))
        levels = 2 ** kivi.key_bits + 2 ** kivi.value_bits
        codebooks = layers * levels * 2 if options.nuq and seq_len else 0  # fp16 levels, K and V, per layer
        return (batch * layers * kv_heads * compressed + codebooks
                + cls.residual(options, shape, batch, seq_len, model_dtype))


def kivi_split(options: KindOptions, seq_len: int) -> tuple[int, int, int]:
    """(sinks, quantized, residual) tokens a KIVI layer holds at seq_len (see layers.KiviLayer)."""
    sinks, residual = min(seq_len, options.sinks), options.kivi.residual_len
    quantized = (seq_len - sinks) // residual * residual
    return sinks, quantized, seq_len - sinks - quantized


def _kivi_head_bytes(options: KindOptions, head_dim: int, tokens: int) -> int:
    """K + V bytes of `tokens` quantized tokens (a multiple of group_size) of one head in one layer.

    keys: tokens·D·bk/8 code bytes + tokens/g groups × D channels × (fp16 scale + fp16 min);
    values: tokens × ceil(D/bs) blocks × (bs·bv/8 code bytes + fp16 scale + fp16 min), bs the value block.
    """
    block, kivi = options.value_block, options.kivi
    keys = tokens * head_dim * kivi.key_bits // 8 + tokens // kivi.group_size * head_dim * 4
    values = tokens * -(-head_dim // block) * (block * kivi.value_bits // 8 + 4)
    return keys + values


def _outlier_chunk_bytes(options: KindOptions, head_dim: int) -> int:
    """K + V bytes of the outliers of one chunk of g tokens of one head: k fp16 values and k indices each side."""
    group = options.kivi.group_size
    count = outlier_count(options.outlier_percent, group, head_dim)
    return 2 * count * (2 + index_dtype(group, head_dim).itemsize)

