"""KV-cache kinds as transformers cache layers, and their measured size.

Kinds (K/V tensors are [B,H,T,D], D = head_dim; the arithmetic lives in quant/):
    fp32, fp16, bf16  K/V stored in that dtype. A kind equal to the model's dtype is transformers' own
                      DynamicLayer, so `model.generate(cache=...)` and our decode loop see the same cache.
    q8_0, q4_0, nf4   symmetric codes per block of 32 values along D, one fp16 scale per block.
    q4_1              asymmetric 4-bit per block of 32 along D: fp16 scale and fp16 minimum per block.
    kivi4, kivi2      KIVI (arXiv 2402.02750): keys per channel over groups of g tokens, values per token (blocks of
                      32 along D), asymmetric 4 / 2 bits; the newest T mod r tokens kept in full precision.
                      Options travel in the kind string: "kivi4" = "kivi4:g32:r32"; "kivi2:g64:r128".
Quantized layers hold only codes + scales (+ the KIVI residual) and hand attention the dequantized K/V in the
dtype they arrived in. Every layer is built from the kind's KindOptions (config.kinds.parse_kind).
Owns: the layers and `cache_bytes` (measured). The registry pairs each kind with its layer and `sizes` estimates
the bytes that must equal `cache_bytes`. Does not know about selection (budget, quality gates, plans) or decoding.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from runner.infer.cache.kivi_codec import KiviCodec
from runner.infer.config.kinds import DTYPES, KindOptions, torch_dtype
from runner.infer.quant.formats import dequantize, dequantize_groups, quantize

STORAGE_DTYPES = {kind: torch_dtype(kind) for kind in DTYPES.values()}  # the plain kinds: K/V stored as is


class CastLayer(DynamicLayer):
    """Stores K/V in the kind's dtype (`storage_dtype`); attention reads them back in the dtype they arrived in."""

    def __init__(self, options: KindOptions, **kwargs):
        super().__init__(**kwargs)
        self.storage_dtype = STORAGE_DTYPES[options.name]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.compute_dtype, self.device = key_states.dtype, key_states.device
        self.dtype = self.storage_dtype
        self.keys = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.values = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None, "set by lazy_initialization"
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)


class QuantLayer(DynamicLayer):
    """Holds codes + scales of K and V (never the float tensors); `keys`/`values` stay None.

    codes [B,H,T,C] and scales [B,H,T,NB] (q4_1: [B,H,T,2·NB]): the sequence is dim -2 of all four, the batch
    dim 0, so crop / reorder / select / repeat apply the same indexing to each (`_map`). Every token is quantized
    on its own, so cropping a token leaves no trace and the layer equals one that never saw it.
    """

    TENSORS: tuple[str, ...] = ("key_codes", "key_scales", "value_codes", "value_scales")

    def __init__(self, options: KindOptions, **kwargs):
        super().__init__(**kwargs)
        self.kind = options.name
        self._forget()

    def _forget(self) -> None:
        for name in self.TENSORS:
            setattr(self, name, None)

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
        """Bytes really held by the tensors in TENSORS."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.TENSORS)

    def reset(self) -> None:
        super().reset()
        self._forget()

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


class FP32Layer(CastLayer):
    pass


class FP16Layer(CastLayer):
    pass


class BF16Layer(CastLayer):
    pass


class Q8_0Layer(QuantLayer):
    pass


class Q4_0Layer(QuantLayer):
    pass


class NF4Layer(QuantLayer):
    pass


class Q4_1Layer(QuantLayer):
    pass


class KiviLayer(KiviCodec, QuantLayer):
    """KIVI: keys per channel over groups of `group_size` tokens, values per token, asymmetric `bits`-bit codes;
    a full-precision residual of the newest tokens, quantized all at once when it reaches `residual_len`.

    Options (KindOptions; kivi_codec.KiviCodec codes and decodes with them, shared with the compiled engine's static
    layer; quant/kivi_math.py holds their arithmetic): the first `sinks` tokens kept exact in the dtype K/V arrive in;
    `outlier_percent` % of each chunk of g tokens × D values kept exact (fp16 + index); keys and/or values rotated
    by a fixed randomized Hadamard matrix before quantizing (`rotate_keys`, `rotate_values`); `levels` = (key
    levels, value levels), fitted non-uniform codes (nuq) instead of uniform steps; `key_bits` / `value_bits` (k4v2)
    different widths for the two sides (the name's `bits` is the default of both); values in blocks of
    `value_block` channels (b64) instead of 32.
    S sinks, Q quantized tokens, r residual tokens, T = S + Q + r; S = min(T, sinks) and Q = floor((T − S) /
    residual_len)·residual_len after every update and crop, so what is held depends only on T (the estimator relies
    on it). Tensors (sequence dim -2, batch 0):
        sink_keys [B,H,S,Dk], sink_values [B,H,S,Dv] in the dtype K/V arrived in
        key_codes [B,H,Q·bk/8,Dk] uint8    key_scales, key_mins [B,H,Q/g,Dk] fp16    (per channel per group)
        value_codes [B,H,Q,NB·bs·bv/8]     value_scales, value_mins [B,H,Q,NB] fp16  (per token per block of bs)
        key_outliers, value_outliers [B,H,Q/g,k] fp16, key_outlier_index, value_outlier_index [B,H,Q/g,k] int16
        residual_keys [B,H,r,Dk], residual_values [B,H,r,Dv] in the dtype K/V arrived in.
    With nuq the scales are the groups' ranges (max − min). The codebooks count once per layer while T > 0.
    """

    TENSORS = ("sink_keys", "sink_values", *KiviCodec.QUANTIZED, "residual_keys", "residual_values")

    def __init__(self, options: KindOptions, levels: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        super().__init__(options, **kwargs)
        kivi = options.kivi
        self.bits, self.key_bits, self.value_bits = options.bits, kivi.key_bits, kivi.value_bits
        self.group_size, self.residual_len = kivi.group_size, kivi.residual_len
        self.value_block = options.value_block
        self.sinks, self.outlier_percent = options.sinks, options.outlier_percent
        self.rotate_keys, self.rotate_values = options.rotate_keys, options.rotate_values
        if options.nuq and levels is None:
            raise ValueError("nuq codes need levels fitted to the model: build the cache with make_cache(kind, model)")
        self.levels = levels if options.nuq else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_dim, self.value_dim = key_states.shape[-1], value_states.shape[-1]
        self._make_rotations(self.key_dim, self.value_dim, self.device, self.rotate_keys, self.rotate_values)
        for name, empty in zip(self.QUANTIZED, self._quantize(key_states[..., :0, :], value_states[..., :0, :])):
            setattr(self, name, empty)
        self.sink_keys, self.sink_values = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
        self.residual_keys, self.residual_values = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
        self.is_initialized = True

    def quantized_len(self) -> int:
        return self.value_codes.shape[-2] if self.is_initialized else 0

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[-2] + self.quantized_len() + self.residual_keys.shape[-2]

    def nbytes(self) -> int:
        """Bytes of the tensors in TENSORS, and of the codebooks while the layer holds tokens."""
        return super().nbytes() + (self._codebook_bytes() if self.get_seq_length() else 0)

    def _dequantized(self, start: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B,H,Q-start,Dk], V [B,H,Q-start,Dv] of quantized tokens start.. in `dtype` (no sinks)."""
        empty_keys, empty_values = self.residual_keys[..., :0, :], self.residual_values[..., :0, :]
        return self._whole(start, empty_keys.to(dtype), empty_values.to(dtype), sinks=False)

    def _whole(self, start: int, keys: torch.Tensor, values: torch.Tensor,
               sinks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The sinks, quantized tokens start.. (start a multiple of group_size), then `keys` / `values` [B,H,n,D],
        in one new tensor each. Decoding's hot path: dequantized straight into the tensor attention reads."""
        held = self.sink_keys.shape[-2] if sinks else 0
        quantized = self.quantized_len() - start
        whole_keys = keys.new_empty((*keys.shape[:-2], held + quantized + keys.shape[-2], keys.shape[-1]))
        whole_values = values.new_empty((*values.shape[:-2], held + quantized + values.shape[-2], values.shape[-1]))
        t = {name: getattr(self, name)[..., self._rows(name, start):, :] for name in self.QUANTIZED}
        self._dequantize_into(t, whole_keys[..., held:held + quantized, :], whole_values[..., held:held + quantized, :])
        whole_keys[..., :held, :] = self.sink_keys[..., :held, :]
        whole_values[..., :held, :] = self.sink_values[..., :held, :]
        whole_keys[..., held + quantized:, :] = keys
        whole_values[..., held + quantized:, :] = values
        return whole_keys, whole_values

    def _dequantize_into(self, t: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor) -> None:
        """The quantized tensors `t` dequantized into views `keys` / `values` (with options: KiviCodec._decoded's
        float32, cast on the copy)."""
        if not self.plain:
            keys.copy_(self._decoded(t, "key", keys.shape[-2]))
            values.copy_(self._decoded(t, "value", self.value_dim))
            return
        dequantize_groups(t["key_codes"], t["key_scales"], t["key_mins"], self.key_bits, self.group_size,
                          keys.shape[-2], keys.dtype, dim=-2, out=keys)
        dequantize_groups(t["value_codes"], t["value_scales"], t["value_mins"], self.value_bits, self.value_block,
                          self.value_dim, values.dtype, dim=-1, out=values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Sinks first; then append [B,H,t,D] K/V to the residual, quantize whole multiples of residual_len of it;
        return all K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        take = min(self.sinks - self.sink_keys.shape[-2], key_states.shape[-2])
        if take > 0:
            self.sink_keys = torch.cat([self.sink_keys, key_states[..., :take, :]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, value_states[..., :take, :]], dim=-2)
            key_states, value_states = key_states[..., take:, :], value_states[..., take:, :]
        keys = torch.cat([self.residual_keys, key_states], dim=-2)  # [B,H,r+t,Dk]
        values = torch.cat([self.residual_values, value_states], dim=-2)
        full = keys.shape[-2] // self.residual_len * self.residual_len
        if full:
            for name, new in zip(self.QUANTIZED, self._quantize(keys[..., :full, :], values[..., :full, :])):
                setattr(self, name, torch.cat([getattr(self, name), new], dim=-2))
            keys, values = keys[..., full:, :].clone(), values[..., full:, :].clone()
        self.residual_keys, self.residual_values = keys, values
        return self._whole(0, keys, values)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens. Dropped whole groups disappear; kept quantized tokens past
        floor(kept / residual_len)·residual_len are dequantized into the residual, so attention sees the same K/V;
        sinks go last."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (got {tokens_to_remove})")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep, held = max(self.get_seq_length() + tokens_to_remove, 0), self.sink_keys.shape[-2]
        if keep < held:
            self.sink_keys, self.sink_values = self.sink_keys[..., :keep, :], self.sink_values[..., :keep, :]
        keep, quantized = max(keep - held, 0), self.quantized_len()
        if keep >= quantized:  # only residual tokens go
            self.residual_keys = self.residual_keys[..., :keep - quantized, :]
            self.residual_values = self.residual_values[..., :keep - quantized, :]
            return
        kept_quantized = keep // self.residual_len * self.residual_len
        keys, values = self._dequantized(kept_quantized, self.residual_keys.dtype)  # tokens kept_quantized..Q
        for name in self.QUANTIZED:
            setattr(self, name, getattr(self, name)[..., :self._rows(name, kept_quantized), :])
        self.residual_keys = keys[..., :keep - kept_quantized, :].clone()
        self.residual_values = values[..., :keep - kept_quantized, :].clone()


class Kivi4Layer(KiviLayer):
    pass


class Kivi3Layer(KiviLayer):
    pass


class Kivi2Layer(KiviLayer):
    pass


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
