"""KV-cache kinds as transformers cache layers, their measured size, and the estimator that must agree with it.

Kinds (K/V tensors are [B,H,T,D], D = head_dim; quantization works on blocks of 32 values along D):
    fp32, fp16, bf16  K/V stored in that dtype. A kind equal to the model's dtype is transformers' own
                      DynamicLayer, so `model.generate(past_key_values=...)` and our decode loop see the same cache.
    q8_0              int8 codes, one fp16 scale per block (absmax/127).
    q4_0              4-bit symmetric codes (absmax/7), two per uint8 byte, one fp16 scale per block.
    nf4               index of the nearest of the 16 NormalFloat levels (absmax-scaled), two per byte, fp16 scale.
A head_dim that is not a multiple of 32 is zero-padded to whole blocks; the padding is stored and counted.
Quantized layers hold only codes + scales and hand attention the dequantized K/V in the dtype they arrived in.
Owns: the quantizers, the layers, `make_cache`, `cache_bytes` (measured) and `estimate_cache_bytes` /
`bytes_per_token` (from a model config). Does not know about selection (budget, quality gates, plans) or decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from runner.infer.config import canonical_kind

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BLOCK = 32
CODE_BITS = {"q8_0": 8, "q4_0": 4, "nf4": 4}
QMAX = {"q8_0": 127, "q4_0": 7, "nf4": 1}  # scale = absmax / QMAX
SCALE_BYTES = 2  # one fp16 scale per block
# The 16 NormalFloat levels of QLoRA (bitsandbytes' NF4 table), ascending.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2  # bucketize against these = nearest level
_NF4_PAIRS = torch.stack([NF4_LEVELS.repeat(16), NF4_LEVELS.repeat_interleave(16)], dim=-1)  # byte → (lo, hi)
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _on(device: torch.device, name: str, table: torch.Tensor) -> torch.Tensor:
    """`table` copied to `device` once, not on every call."""
    if (name, device) not in _ON_DEVICE:
        _ON_DEVICE[name, device] = table.to(device)
    return _ON_DEVICE[name, device]


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float → codes [..., NB*32] int8 (q8_0) or [..., NB*16] uint8 (4-bit), scales [..., NB] fp16."""
    blocks = F.pad(x.float(), (0, -x.shape[-1] % BLOCK)).unflatten(-1, (-1, BLOCK))  # [..., NB, 32]
    absmax = blocks.abs().amax(-1, keepdim=True)  # [..., NB, 1]
    fp16_max = torch.finfo(torch.float16).max
    scales = (absmax / QMAX[kind]).clamp(max=fp16_max).half()  # [..., NB, 1]
    scaled = blocks / torch.where(scales > 0, scales.float(), 1.0)  # zero block → all codes mean 0
    if kind == "q8_0":
        return scaled.round().clamp(-127, 127).to(torch.int8).flatten(-2), scales.squeeze(-1)
    if kind == "q4_0":
        codes = (scaled.round().clamp(-7, 7) + 8).to(torch.uint8)  # [..., NB, 32] in 1..15
    elif kind == "nf4":
        midpoints = _on(x.device, "midpoints", _NF4_MIDPOINTS)
        codes = torch.bucketize(scaled.contiguous(), midpoints).to(torch.uint8)  # [..., NB, 32] in 0..15
    else:
        raise ValueError(f"unknown quantized kind {kind!r}")
    codes = codes.flatten(-2).unflatten(-1, (-1, 2))  # [..., NB*16, 2]
    return codes[..., 0] | (codes[..., 1] << 4), scales.squeeze(-1)  # even index in the low nibble


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: codes [..., C], scales [..., NB] → [..., head_dim] in `dtype` (padding cropped)."""
    if kind == "q8_0":
        values = codes.float()  # [..., NB*32]
    elif kind == "q4_0":
        values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).float() - 8  # [..., NB*32]
    else:  # one lookup per byte: a 256 × 2 table of (low, high) levels, 2× faster than a lookup per nibble
        values = F.embedding(codes.long(), _on(codes.device, "pairs", _NF4_PAIRS)).flatten(-2)  # [..., NB*32]
    blocks = values.unflatten(-1, (-1, BLOCK)) * scales.float().unsqueeze(-1)  # [..., NB, 32]
    return blocks.flatten(-2)[..., :head_dim].to(dtype)


def head_bytes(kind: str, head_dim: int) -> int:
    """Bytes one quantized head vector of `head_dim` values takes: codes of whole blocks + one scale per block."""
    n_blocks = -(-head_dim // BLOCK)
    return n_blocks * (BLOCK * CODE_BITS[kind] // 8 + SCALE_BYTES)


class CastLayer(DynamicLayer):
    """Stores K/V in `storage_dtype`; attention reads them back in the dtype they arrived in."""

    storage_dtype: torch.dtype = torch.float16

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.compute_dtype, self.device = key_states.dtype, key_states.device
        self.dtype = self.storage_dtype
        self.keys = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.values = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)


class QuantLayer(DynamicLayer):
    """Holds codes + scales of K and V (never the float tensors); `keys`/`values` stay None.

    codes [B,H,T,C] and scales [B,H,T,NB]: the sequence is dim -2 of all four, the batch dim 0, so crop / reorder /
    select / repeat apply the same indexing to each (`_map`). Every token is quantized on its own, so cropping
    a token leaves no trace and the layer equals one that never saw it.
    """

    kind: str = "q8_0"
    TENSORS = ("key_codes", "key_scales", "value_codes", "value_scales")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.key_codes = self.key_scales = self.value_codes = self.value_scales = None

    def _map(self, fn) -> None:
        for name in self.TENSORS:
            setattr(self, name, fn(getattr(self, name)))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_dim, self.value_dim = key_states.shape[-1], value_states.shape[-1]  # may differ (MLA)
        self.key_codes, self.key_scales = quantize(key_states[..., :0, :], self.kind)  # empty, right shapes
        self.value_codes, self.value_scales = quantize(value_states[..., :0, :], self.kind)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new [B,H,t,D] K/V quantized; return the whole dequantized [B,H,T,D] K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_codes, key_scales = quantize(key_states, self.kind)
        value_codes, value_scales = quantize(value_states, self.kind)
        self.key_codes = torch.cat([self.key_codes, key_codes], dim=-2)
        self.key_scales = torch.cat([self.key_scales, key_scales], dim=-2)
        self.value_codes = torch.cat([self.value_codes, value_codes], dim=-2)
        self.value_scales = torch.cat([self.value_scales, value_scales], dim=-2)
        return (dequantize(self.key_codes, self.key_scales, self.kind, self.key_dim, key_states.dtype),
                dequantize(self.value_codes, self.value_scales, self.kind, self.value_dim, value_states.dtype))

    def get_seq_length(self) -> int:
        return self.key_codes.shape[-2] if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes really held: codes + scales of K and V."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.TENSORS)

    def reset(self) -> None:
        super().reset()
        self.key_codes = self.key_scales = self.value_codes = self.value_scales = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (a negative count, as in DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (got {tokens_to_remove})")
        if tokens_to_remove < 0 and self.is_initialized:
            self._map(lambda t: t[..., :tokens_to_remove, :])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map(lambda t: t[indices, ...])

    def offload(self) -> None:
        if self.is_initialized:
            self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.key_codes.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))


class Q8_0Layer(QuantLayer):
    kind = "q8_0"


class Q4_0Layer(QuantLayer):
    kind = "q4_0"


class NF4Layer(QuantLayer):
    kind = "nf4"


CACHE_KINDS: dict[str, type[DynamicLayer]] = {
    **{name: type(f"{name.upper()}Layer", (CastLayer,), {"storage_dtype": dtype})
       for name, dtype in STORAGE_DTYPES.items()},
    "q8_0": Q8_0Layer, "q4_0": Q4_0Layer, "nf4": NF4Layer,
}


def _checked(kind: str | None) -> str | None:
    """The canonical name of `kind` (None stays None); ValueError for an unknown one."""
    if kind is None:
        return None
    if canonical_kind(kind) not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; known: {', '.join(CACHE_KINDS)} (aliases q8, q4)")
    return canonical_kind(kind)


def make_cache(kind: str | None, model) -> Cache:
    """An empty cache of `kind` (aliases ok) for `model`; None or the model's own dtype → transformers' DynamicCache."""
    kind = _checked(kind)
    if kind is None or STORAGE_DTYPES.get(kind) == model.dtype:
        return DynamicCache(config=model.config)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[CACHE_KINDS[kind]() for _ in range(n_layers)])


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache really holds (measured from its tensors, not estimated)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
            continue
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def bytes_per_token(config, kind: str | None, model_dtype: torch.dtype) -> int:
    """Cache bytes one token of one sequence adds, over all layers, K and V (`kind` None = the model's dtype)."""
    text = config.get_text_config(decoder=True)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kind = _checked(kind)
    if kind in CODE_BITS:
        per_head = head_bytes(kind, head_dim)
    else:
        per_head = head_dim * (STORAGE_DTYPES[kind] if kind is not None else model_dtype).itemsize
    return 2 * text.num_hidden_layers * kv_heads * per_head


def estimate_cache_bytes(config, kind: str | None, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
    """Bytes a cache of `kind` holds at `batch` × `seq_len` tokens; equals `cache_bytes` for llama-style models."""
    return batch * seq_len * bytes_per_token(config, kind, model_dtype)
