"""Static caches for the compiled engine: every cache kind preallocated at a fixed number of columns, written in
place by column, so a compiled decode step sees the same shapes and the same storage at every step.

Layouts (B rows, H KV heads, S columns = the cache's length, D head_dim; the arithmetic is quant.py's):
    fp32, fp16, bf16   keys / values [B,H,S,D] in that dtype; attention reads them cast to the compute dtype.
    q8_0 q4_0 q4_1 nf4 codes [B,H,S,C] and scales [B,H,S,NB] (q4_1: [B,H,S,2·NB]); every column is quantized on
                       its own, so writing a column by index equals the eager layer's append.
    kivi4, kivi2       not here: their keys are quantized per channel over groups of tokens that fill up over
                       several steps (see kvcache.KiviLayer); the compiled engine refuses them.
A column is a slot of the cache, not a token position: rows of a left-padded batch share columns, the mask says
which columns of a row are real. `StaticKVCache.columns` ([T] long) says where the next forward writes; the
engine sets it before each forward. Attention reads all S columns (the mask hides unwritten ones), so the
dequantization of a quantized kind is one elementwise expression over fixed shapes that inductor fuses per layer.
Owns: the layers, `make_static_cache` and `STATIC_KINDS`; kvcache.cache_bytes measures them (`nbytes`). Does not know about
compilation, masks, decoding or selection.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

from runner.infer.config import parse_kind
from runner.infer.kvcache import STORAGE_DTYPES, _dims
from runner.infer.quant import CODE_BITS, dequantize, quantize

STATIC_KINDS = (*STORAGE_DTYPES, *CODE_BITS)  # every kind but KIVI


class StaticPlainLayer(StaticLayer):
    """K/V stored as is, in `storage` dtype, [B,H,S,D]."""

    TENSORS: tuple[str, ...] = ("keys", "values")

    def __init__(self, batch: int, heads: int, length: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, storage: torch.dtype | None = None):
        super().__init__(max_cache_len=length)
        self.dtype, self.device, self.batch_size, self.num_heads = dtype, device, batch, heads
        self.k_head_dim, self.v_head_dim = key_dim, value_dim
        self.storage = storage or dtype
        self.allocate()
        self.is_initialized = True

    def allocate(self) -> None:
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*shape, self.k_head_dim), dtype=self.storage, device=self.device)
        self.values = torch.zeros((*shape, self.v_head_dim), dtype=self.storage, device=self.device)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front: a compiled step must never allocate the cache

    def write(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor):
        """[B,H,T,D] new K/V into `columns` [T] → all [B,H,S,D] K/V in the dtype they came in."""
        self.keys.index_copy_(2, columns, keys.to(self.storage))
        self.values.index_copy_(2, columns, values.to(self.storage))
        return self.keys.to(keys.dtype), self.values.to(values.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows follow their parent beams, in place (the storage keeps its address)."""
        for t in self.tensors():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def get_seq_length(self) -> int:
        return self.max_cache_len


class StaticQuantLayer(StaticPlainLayer):
    """codes + scales of K and V per column (quant.quantize along D); attention reads them dequantized."""

    TENSORS = ("key_codes", "key_scales", "value_codes", "value_scales")
    kind: str = "q8_0"

    def __init__(self, *args, kind: str = "q8_0", **kwargs):
        self.kind = kind
        super().__init__(*args, **kwargs)

    def allocate(self) -> None:
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        for side, dim in (("key", self.k_head_dim), ("value", self.v_head_dim)):
            codes, scales = quantize(torch.zeros(*shape, dim, device=self.device), self.kind)
            setattr(self, f"{side}_codes", codes)
            setattr(self, f"{side}_scales", scales)
        self.keys = self.values = None

    def write(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor):
        """Quantize the new [B,H,T,D] K/V into `columns` [T] → all [B,H,S,D] K/V dequantized."""
        for side, new in (("key", keys), ("value", values)):
            codes, scales = quantize(new, self.kind)  # [B,H,T,C], [B,H,T,NB]
            getattr(self, f"{side}_codes").index_copy_(2, columns, codes)
            getattr(self, f"{side}_scales").index_copy_(2, columns, scales)
        return (dequantize(self.key_codes, self.key_scales, self.kind, self.k_head_dim, keys.dtype),
                dequantize(self.value_codes, self.value_scales, self.kind, self.v_head_dim, values.dtype))


class StaticKVCache(Cache):
    """One static layer per model layer and the columns the next forward writes."""

    def __init__(self, layers: list[StaticPlainLayer], kind: str):
        super().__init__(layers=layers)
        self.kind = kind
        self.columns = torch.zeros(1, dtype=torch.long, device=layers[0].device)  # [T]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].write(key_states, value_states, self.columns)

    @property
    def batch(self) -> int:
        return self.layers[0].batch_size

    @property
    def length(self) -> int:
        return self.layers[0].max_cache_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow [b] parents; dummy rows past b stay where they are."""
        rest = torch.arange(len(beam_idx), self.batch, device=beam_idx.device)
        for layer in self.layers:
            layer.reorder_cache(torch.cat([beam_idx, rest]))


def make_static_cache(kind: str | None, model, batch: int, length: int) -> StaticKVCache:
    """A zeroed static cache of `kind` (None = the model's dtype) for `model`: `batch` rows × `length` columns."""
    name, _ = parse_kind(kind)
    name = name or {v: k for k, v in STORAGE_DTYPES.items()}.get(model.dtype)
    if name not in STATIC_KINDS:
        raise ValueError(f"the compiled engine has no static layout for cache kind {kind!r}: "
                         f"use one of {', '.join(STATIC_KINDS)}")
    n_layers, heads, head_dim = _dims(model.config)
    device = next(model.parameters()).device
    common = dict(batch=batch, heads=heads, length=length, key_dim=head_dim, value_dim=head_dim, dtype=model.dtype,
                  device=device)
    if name in CODE_BITS:
        layers = [StaticQuantLayer(**common, kind=name) for _ in range(n_layers)]
    else:
        layers = [StaticPlainLayer(**common, storage=STORAGE_DTYPES[name]) for _ in range(n_layers)]
    return StaticKVCache(layers, name)

