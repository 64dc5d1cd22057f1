"""Static layouts of the plain and block kinds (fp32 / fp16 / bf16, q8_0 / q4_0 / q4_1 / nf4) for the compiled
engine: preallocated at a fixed number of columns and written in place by column (layouts: static/cache.py's
docstring). Built from the kind's KindOptions, as the eager layers are.
Owns: StaticPlainLayer (also the base of static/kivi.StaticKiviLayer) and StaticQuantLayer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

from runner.infer.cache.evicting import EvictInputs, gather_columns
from runner.infer.config.kinds import KindOptions, torch_dtype
from runner.infer.kernels import cpu_attention
from runner.infer.quant.formats import NF4_LEVELS, dequantize_expr, quantize

NF4_KERNEL_LEVELS = cpu_attention.levels16(NF4_LEVELS)  # made once, not at every step


class StaticPlainLayer(StaticLayer):
    """K/V stored as is, [B,H,S,D], in `storage`: the kind's dtype (fp32 / fp16 / bf16), else the model's `dtype`
    (the full-precision columns of a subclass: KIVI's sinks and ring)."""

    TENSORS: tuple[str, ...] = ("keys", "values")
    device: torch.device  # given to __init__, never None
    evict_inputs: EvictInputs | None = None  # the pre-hook's, within a scored prompt forward (StaticKVCache)

    @staticmethod
    def columns(options: KindOptions, length: int) -> int:
        """Columns a layer of these options holds for `length` wanted (make_static_cache's `length`)."""
        return length

    def __init__(self, options: KindOptions, batch: int, heads: int, length: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(max_cache_len=length)
        self.dtype, self.device, self.batch_size, self.num_heads = dtype, device, batch, heads
        self.k_head_dim, self.v_head_dim = key_dim, value_dim
        self.storage = torch_dtype(options.name) if options.family == "float" else dtype
        self.allocate()
        self.is_initialized = True

    def allocate(self) -> None:
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*shape, self.k_head_dim), dtype=self.storage, device=self.device)
        self.values = torch.zeros((*shape, self.v_head_dim), dtype=self.storage, device=self.device)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front: a compiled step must never allocate the cache

    def write(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, end: torch.Tensor):
        """[B,H,T,D] new K/V into `columns` [T] → all [B,H,S,D] K/V in the dtype they came in. Columns from `end`
        (0-d) on are padding of a compiled prefill: written, masked, overwritten later."""
        held_keys, held_values = self._held()
        held_keys.index_copy_(2, columns, keys.to(self.storage))
        held_values.index_copy_(2, columns, values.to(self.storage))
        return held_keys.to(keys.dtype), held_values.to(values.dtype)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V [B,H,S,D] (this class's layout: subclasses that store codes never call it)."""
        assert self.keys is not None and self.values is not None, "allocate() sets keys and values"
        return self.keys, self.values

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]

    def kernel_reads(self, dtype: torch.dtype) -> bool:
        """Whether cpu_attention's kernel reads this layer as attention in `dtype` does. The kernel attends over
        the decoded values in float32, where the torch path hands attention K/V rounded to the model's dtype: so
        a float32 model, or K/V stored in the model's dtype."""
        return dtype == torch.float32 or self.storage == dtype

    def sides(self) -> tuple[cpu_attention.Side, cpu_attention.Side]:
        """K and V as cpu_attention's kernel reads them."""
        storage = cpu_attention.STORAGE_FORMATS[self.storage]
        keys, values = self._held()
        return (cpu_attention.Side(keys, storage, self.k_head_dim),
                cpu_attention.Side(values, storage, self.v_head_dim))

    def attend(self, query: torch.Tensor, mask: torch.Tensor, scaling: float, columns: torch.Tensor,
               end: torch.Tensor) -> torch.Tensor:
        """One query column [B,Hq,1,D] over the columns written so far (after this step's write), [B,S] bool mask
        → [B,1,Hq,Dv]: cpu_attention's kernel reading the stored K/V (no dequantized copy)."""
        keys, values = self.sides()
        return cpu_attention.attend(query, keys, values, mask, scaling, columns[-1] + 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def held_bytes(self, rows: int, columns: int) -> int:
        """Bytes of the first `columns` columns of the first `rows` rows (what a state holds; every column of
        these layouts holds one token's codes, the same bytes)."""
        return sum(t[:rows, :, :columns].numel() * t.element_size() for t in self.tensors())

    def compact(self, start: int, index: torch.Tensor) -> None:
        """Keep the columns start + index [B,H,k] (ascending, each < the columns written from `start`), moved to
        start..start+k−1 of their (row, KV head) in place: every stored tensor gathered along its columns, so the
        block kinds' codes and scales move as they are (exact: each column is coded on its own)."""
        k = index.shape[-1]
        for t in self.tensors():
            t[:, :, start:start + k] = gather_columns(t[:, :, start:], index)

    def take_columns(self, row: int | slice, source: StaticPlainLayer, source_row: int | slice, start: int,
                     stop: int, shift: int = 0) -> None:
        """Columns [start, stop) of `source`'s row(s) `source_row` (a layer of the same kind, or this one) into
        columns [start + shift, stop + shift) of row(s) `row`: serve/compiled_slots.py places a prefilled request
        so, and moves every row's columns on a rebase (`slice(None)`, this layer: the columns they leave hold stale
        values). In place: the tensors keep their addresses."""
        for whole, part in zip(self.tensors(), source.tensors()):
            whole[row, :, start + shift:stop + shift] = part[source_row, :, start:stop].clone()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Rows follow their parent beams, in place (the storage keeps its address)."""
        for t in self.tensors():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def get_seq_length(self) -> int:
        return self.max_cache_len


class StaticQuantLayer(StaticPlainLayer):
    """codes + scales of K and V per column (quant.quantize along D); attention reads them dequantized."""

    TENSORS = ("key_codes", "key_scales", "value_codes", "value_scales")
    key_codes: torch.Tensor  # [B,H,S,C], [B,H,S,NB] (set by allocate)
    key_scales: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor

    def __init__(self, options: KindOptions, *args, **kwargs):
        self.kind = options.name
        super().__init__(options, *args, **kwargs)

    def allocate(self) -> None:
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        for side, dim in (("key", self.k_head_dim), ("value", self.v_head_dim)):
            codes, scales = quantize(torch.zeros(*shape, dim, device=self.device), self.kind)
            setattr(self, f"{side}_codes", codes)
            setattr(self, f"{side}_scales", scales)
        self.keys = self.values = None

    def kernel_reads(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32  # decoded values, never stored in the model's dtype

    def sides(self) -> tuple[cpu_attention.Side, cpu_attention.Side]:
        levels = NF4_KERNEL_LEVELS if self.kind == "nf4" else None
        keys, values = (cpu_attention.Side(getattr(self, f"{side}_codes"), self.kind, dim,
                                           scales=getattr(self, f"{side}_scales"), levels=levels)
                        for side, dim in (("key", self.k_head_dim), ("value", self.v_head_dim)))
        return keys, values

    def write(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, end: torch.Tensor):
        """Quantize the new [B,H,T,D] K/V into `columns` [T] → all [B,H,S,D] K/V dequantized."""
        for side, new in (("key", keys), ("value", values)):
            codes, scales = quantize(new, self.kind)  # [B,H,T,C], [B,H,T,NB]
            getattr(self, f"{side}_codes").index_copy_(2, columns, codes)
            getattr(self, f"{side}_scales").index_copy_(2, columns, scales)
        return (dequantize_expr(self.key_codes, self.key_scales, self.kind, self.k_head_dim, keys.dtype),
                dequantize_expr(self.value_codes, self.value_scales, self.kind, self.v_head_dim, values.dtype))
