"""Static caches for the compiled engine: every cache kind preallocated at a fixed number of columns, written in
place by column, so a compiled decode step sees the same shapes and the same storage at every step.

Layouts (B rows, H KV heads, S columns = the cache's length, D head_dim; the arithmetic is quant.py's):
    fp32, fp16, bf16   keys / values [B,H,S,D] in that dtype; attention reads them cast to the compute dtype.
    q8_0 q4_0 q4_1 nf4 codes [B,H,S,C] and scales [B,H,S,NB] (q4_1: [B,H,S,2·NB]); every column is quantized on
                       its own, so writing a column by index equals the eager layer's append.
    kivi4 kivi3 kivi2  s sinks (option s, default 0): columns [0, s) as they came, never quantized. Then
                       layers.KiviLayer's six quantized tensors over the S − s columns after them (keys per channel
                       over groups of g columns at bk bits, values per column at bv bits in blocks of bs channels;
                       k4v3: bk = 4, bv = 3; b64: bs = 64, else 32) and a ring of R = 2r full-precision columns
                       (column s + c in slot c mod R) holding the residual: columns [s + Q, T), Q = floor((T − s) /
                       r)·r. S − s is a multiple of R. A write fills the sinks, appends to the ring and quantizes the
                       block of r columns it completes (fixed-shape `where`s, no shape ever changes); attention
                       reads the sinks, the region dequantized below s + Q and the ring above, so it sees what the
                       eager layer sees at every step (StaticKiviLayer). Every KIVI option: blocks are coded and the
                       region decoded by kivicodec.KiviCodec, the eager layer's own code; outliers (o) in the
                       eager layer's [B,H,(S−s)/g,k] values and indices, nuq's levels (fitted as make_cache fits
                       them) and the rotation matrices (rot, rotv) held by the layer on its device.
A column is a slot of the cache, not a token position: rows of a left-padded batch share columns, the mask says
which columns of a row are real. `StaticKVCache.columns` ([T] long) says where the next forward writes and
`StaticKVCache.end` (0-d) where its padding starts (a compiled prefill pads its last piece on the right); the
engine sets both before each forward. Attention reads all S columns (the mask hides unwritten ones), so the
dequantization of a quantized kind is one elementwise expression over fixed shapes (quant.dequantize_expr,
dequantize_groups_expr: unpacking, scale and minimum). The compiled engine's one-column attention reads it on CPU
through each layer's `attend` (cpu_attention's kernel over the stored codes: no float K/V at all); elsewhere it
sums products over that expression (attention.attend_reduced), so inductor computes it inside those sums and no
full-size float K/V is written (except with KIVI's outliers or rotation: a scatter and a matrix product).
The layers are static/plain.py's (plain and block kinds) and static/kivi.py's (KIVI), named by the registry.
Owns: `StaticKVCache`, `make_static_cache`, `static_length` and `STATIC_KINDS`; layers.cache_bytes measures the
layers (`nbytes`). Does not know about compilation, masks, decoding or selection.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from runner.infer.cache.evicting import RECEIVES, EvictInputs, choose_columns, install_hooks, kept_mask
from runner.infer.cache.registry import KINDS, NATIVE_KINDS, layer_levels
from runner.infer.cache.sizes import dims
from runner.infer.cache.static.kivi import StaticKiviLayer
from runner.infer.cache.static.plain import StaticPlainLayer
from runner.infer.config.eviction import EvictionOptions, compiled_eviction_reason
from runner.infer.config.kinds import parse_kind
from runner.infer.kernels import cpu_attention, heap

STATIC_KINDS = tuple(KINDS)  # every kind, every KIVI option


class StaticKVCache(Cache):
    """One static layer per model layer and the columns the next forward writes."""

    def __init__(self, layers: list[StaticPlainLayer], kind: str, eviction: EvictionOptions | None = None):
        if layers[0].device.type == "cpu":  # a step writes a column of every row and head, reads all held columns
            heap.layers_onto_huge_pages(layers)
        super().__init__(layers=[*layers])
        self.static_layers = layers  # self.layers' layers, typed as the static layers they are
        self.kind = kind
        assert eviction is None or not isinstance(layers[0], StaticKiviLayer), "compiled_eviction_reason refuses it"
        self.eviction = eviction  # a kind with eviction: each prompt forward scored (`score_next`), then `compact`
        setattr(self, RECEIVES, False)  # true only within a scored prompt forward (eager): the pre-hook's inputs
        self.valid: torch.Tensor | None = None  # [B,t] real columns of the scored forward
        self.chosen: list[torch.Tensor | None] = [None] * len(layers)  # per layer: kept columns [B,H,k] of it
        self.columns = torch.zeros(1, dtype=torch.long, device=layers[0].device)  # [T]
        self.end = torch.ones((), dtype=torch.long, device=layers[0].device)  # 0-d: columns from here are padding

    def code_blocks(self, on: bool, views: bool = True) -> None:
        """Whether the next writes code the blocks they complete and keep the sinks (KIVI; the default). Off, a
        write fills only the ring, and its graph holds no quantizer and no sink copies: the compiled one-column
        step of every column that needs neither (`needs_coding`). `views` off, a KIVI write hands attention no K/V
        (0 columns; decoding the whole region is most of an eager step's time): only when every layer is read by
        cpu_attention's kernel (`kernel_attends`), which attention then must do."""
        for layer in self.static_layers:
            if isinstance(layer, StaticKiviLayer):
                layer.code_blocks, layer.views = on, views

    def kernel_attends(self, dtype: torch.dtype) -> bool:
        """Whether one-column attention in `dtype` reads every layer through cpu_attention's kernel
        (attention.attend_reduced with this cache handed over)."""
        return (self.static_layers[0].device.type == "cpu" and cpu_attention.ready()
                and all(layer.kernel_reads(dtype) for layer in self.static_layers))

    def codes_columns(self) -> bool:
        """Whether writes code blocks or keep sinks (KIVI): a write with `code_blocks` off is then another graph."""
        return isinstance(self.static_layers[0], StaticKiviLayer)

    def needs_coding(self, start: int, count: int) -> bool:
        """Whether writing `count` columns from column `start` completes a KIVI block or writes a sink (never for
        other kinds): what a write with `code_blocks` off does not do."""
        layer = self.static_layers[0]
        if not isinstance(layer, StaticKiviLayer):  # not self.codes_columns()
            return False
        blocks = lambda columns: max(columns - layer.sinks, 0) // layer.residual_len  # noqa: E731
        return start < layer.sinks or blocks(start + count) > blocks(start)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.static_layers[layer_idx]
        if not getattr(self, RECEIVES):
            return layer.write(key_states, value_states, self.columns, self.end)
        return self._scored_write(layer, layer_idx, key_states, value_states)

    # eviction (a float or block kind; compiled/state.py drives it): a prompt forward of t > 1 columns runs eagerly
    # with `score_next` set; each layer's update chooses its kept columns from the exact K/V, as the eager engine's
    # EvictingMixin does, and stores every column; `compact` then moves the kept ones to the forward's first columns.

    def score_next(self, valid: torch.Tensor) -> None:
        """The next forward (eager, t > 1 columns, valid [B,t] its real ones) is a prompt forward to score."""
        assert self.eviction is not None, "a cache without eviction scores nothing"
        setattr(self, RECEIVES, True)
        self.valid, self.chosen = valid, [None] * len(self.static_layers)

    def _scored_write(self, layer: StaticPlainLayer, layer_idx: int, key_states: torch.Tensor,
                      value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose the layer's kept columns of the new [B,H,t,D] K/V (scored as the eager layer scores them), write
        them all; attention sees the forward's own K/V exact (as EvictingMixin hands them) over the stored rest."""
        assert self.eviction is not None and self.valid is not None, "score_next first"
        inputs: EvictInputs | None = getattr(layer, "evict_inputs", None)
        layer.evict_inputs = None
        t = key_states.shape[-2]
        kept = self.eviction.kept(t)
        if inputs is None or kept >= t:
            return layer.write(key_states, value_states, self.columns, self.end)
        self.chosen[layer_idx] = choose_columns(self.eviction, inputs, key_states, value_states, self.valid, kept, 0)
        keys, values = layer.write(key_states, value_states, self.columns, self.end)
        return (keys.index_copy(2, self.columns, key_states.to(keys.dtype)),
                values.index_copy(2, self.columns, value_states.to(values.dtype)))

    def stop_scoring(self) -> None:
        """Back to plain writes, the scores forgotten (after `compact`, or a scored forward that failed)."""
        setattr(self, RECEIVES, False)
        self.valid, self.chosen = None, [None] * len(self.static_layers)
        for layer in self.static_layers:
            layer.evict_inputs = None

    def compact(self, start: int) -> torch.Tensor | None:
        """After a scored forward written from column `start`: every layer keeps its chosen columns, moved to
        start..start+k−1 per (row, KV head), in order (plain K/V or the block kinds' codes and scales: exact) →
        the [B,k] mask of the kept columns (a row's pads first, as the eager engine's), or None: nothing evicted."""
        chosen, valid = self.chosen, self.valid
        self.stop_scoring()
        if any(index is None for index in chosen):
            assert all(index is None for index in chosen), "every layer scores a forward of the same columns"
            return None
        for layer, index in zip(self.static_layers, chosen):
            assert index is not None
            layer.compact(start, index)
        assert chosen[0] is not None and valid is not None
        return kept_mask(valid, chosen[0], chosen[0])

    @property
    def batch(self) -> int:
        return self.static_layers[0].batch_size

    @property
    def length(self) -> int:
        return self.static_layers[0].max_cache_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def rollback(self, kept: int, held: int) -> None:
        """The write position moved back from `held` to `kept` columns (a speculative crop): layers that keep
        columns in two forms (KIVI) move the kept ones where a later write expects them."""
        for layer in self.static_layers:
            if hasattr(layer, "rollback"):
                layer.rollback(kept, held)

    def take_columns(self, row: int | slice, source: StaticKVCache, source_row: int | slice, start: int, stop: int,
                     shift: int = 0) -> None:
        """Every layer's `take_columns`: columns [start, stop) of `source`'s row(s) `source_row` (a cache of the
        same kind, or this one) into columns [start + shift, stop + shift) of row(s) `row`."""
        for into, layer in zip(self.static_layers, source.static_layers):
            into.take_columns(row, layer, source_row, start, stop, shift)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow [b] parents; dummy rows past b stay where they are."""
        rest = torch.arange(len(beam_idx), self.batch, device=beam_idx.device)
        for layer in self.static_layers:
            layer.reorder_cache(torch.cat([beam_idx, rest]))


def static_length(kind: str | None, length: int) -> int:
    """Columns a static cache of `kind` holds for `length` wanted: KIVI's sinks and whole rings (2r) after them."""
    options = parse_kind(kind)
    return length if options is None else KINDS[options.name].static.columns(options, length)


def make_static_cache(kind: str | None, model, batch: int, length: int) -> StaticKVCache:
    """A zeroed static cache of `kind` (None = the model's dtype) for `model`: `batch` rows × `length` columns
    (KIVI: `static_length` of them)."""
    if reason := compiled_eviction_reason(kind):
        raise ValueError(reason)
    options = parse_kind(kind if kind is not None else NATIVE_KINDS.get(model.dtype))
    if options is None:
        raise ValueError(f"the compiled engine has no static layout for cache kind {kind!r}: "
                         f"use one of {', '.join(STATIC_KINDS)}")
    n_layers, heads, head_dim = dims(model.config)
    device = next(model.parameters()).device
    if device.type == "cpu":
        cpu_attention.load()  # attention then reads the cache through the kernel (attention.attend_reduced)
    static = KINDS[options.name].static
    shape = dict(batch=batch, heads=heads, length=static.columns(options, length), key_dim=head_dim,
                 value_dim=head_dim, dtype=model.dtype, device=device)
    layers = [static(options, **shape, **extra) for extra in layer_levels(model, options, n_layers)]
    if options.eviction is not None:
        install_hooks(model)  # the attention modules hand a scored forward's inputs to its layers
    return StaticKVCache(layers, options.name, options.eviction)
