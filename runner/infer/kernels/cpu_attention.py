"""One-query attention over a CPU cache in its stored format: decode_attention.cpp, registered as two C++ torch ops
(attention_ops.cpp), so a compiled decode step calls them as opaque kernels, as cheaply as aten's.

Why a hand-written kernel: inductor's code for attention over a dequantized cache decodes every column once per
query head of its KV head and ends every column's product in its own horizontal sum, so a packed cache decoded far
slower than fp16 at long context (figures: docs/performance.md). The kernel decodes each column once into a float
row (a few vector instructions, L1-resident) and takes it against all G query heads; it reads fp32 / fp16 / bf16
caches the same way, so every kind is timed through the same code.
    cache_scores(queries, segments…)  [Q,B,H,G,D] → [B,H,G,S] scaled scores, -inf where no segment holds a
                                      column or the mask is 0
    cache_weighted(probs, segments…)  [B,H,G,S] → [O,B,H,G,Dv], columns whose probabilities are all 0 not read
A store is the tensors of one side (K or V) of a layer, [B,H,…] contiguous, and its `layout` (format, dim, bits,
group, plane, padded, outlier chunk): what the kernel's `Store` is made from (attention_ops.cpp). A segment is a
store and the columns of the call it holds, so KIVI's sinks, quantized region and full-precision ring are read in
one call, under one softmax.
Outliers kept exact (KIVI's o option) are written over the decoded values of their column, as
kvcodes.restore_outliers writes them back.
Built by runner.infer.kernels.native (once per machine, under ~/.cache/runner/kernels); no compiler (or a failed
build) →
`load()` is False and callers keep their torch expression of attention.
Owns: the ops' arguments and their fake tensors. Knows nothing of cache classes, models or compilation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.infer.kernels import native

FORMATS = {"fp32": 0, "fp16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "nf4": 5, "q4_1": 6, "kivi_value": 7,
           "kivi_key": 8}
STORAGE_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
SEGMENT_FIELDS = ("start", "start_plus_limit", "stop", "stop_plus_limit", "base", "modulo", "query", "output")


_READY: list[bool] = []  # set by `load`; read while tracing, so a plain global, not a cached call


def load() -> bool:
    """Load runner's kernels (native.load) and give the ops their fake tensors; False when they cannot be. Called
    outside compiled code (a static cache's construction), so that `ready` is a global a trace can read."""
    if not _READY and native.load():
        torch.library.register_fake("runner::cache_scores")(
            lambda queries, tensors, layouts, mask, columns, limit, scaling: queries.new_empty(
                *queries.shape[1:4], columns))
        torch.library.register_fake("runner::cache_weighted")(
            lambda probs, tensors, layouts, outputs, limit: probs.new_empty(outputs, *probs.shape[:3], layouts[1]))
        _READY.append(True)
    return bool(_READY)


def ready() -> bool:
    """The kernel is loaded (`load` succeeded)."""
    return bool(_READY)


@dataclass
class Side:
    """One side (K or V) of a layer's cache as the kernel reads it: [B,H,…] tensors and their `Store` layout."""

    codes: torch.Tensor
    format: str
    dim: int
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    bits: int = 0  # KIVI: code bits
    group: int = 0  # KIVI values: channels per block; keys: columns per group
    plane: int = 0  # KIVI values at 2 and 4 bits: quant.plane_bytes
    padded: int = 0  # KIVI values: channels coded (whole blocks)
    chunk: int = 0  # KIVI outliers: columns per chunk
    outliers: torch.Tensor | None = None  # [B,H,chunks,k] fp16
    index: torch.Tensor | None = None  # [B,H,chunks,k] int16 / int32
    levels: torch.Tensor | None = None  # float32: nf4's 16, KIVI's 2^bits (uniform: 0, 1, …)

    @property
    def tensors(self) -> list:
        return [self.codes, self.scales, self.mins, self.outliers, self.index, self.levels]

    @property
    def layout(self) -> list[int]:
        return [FORMATS[self.format], self.dim, self.bits, self.group, self.plane, self.padded, self.chunk]


@dataclass
class Segment:
    """The columns of a call one side holds: [start, stop), each plus the call's `limit` where said, column t
    being the side's column t − base (mod `modulo`, a ring, when not 0). A plain cache is one segment, the
    columns below the limit; KIVI's are the sinks, the region below the limit and the ring after it."""

    side: Side
    start: int = 0
    stop: int = 0
    start_plus_limit: bool = False
    stop_plus_limit: bool = True
    base: int = 0
    modulo: int = 0
    query: int = 0  # scores: which of the query sets it is taken against (a rotated side's query)
    output: int = 0  # weighted: which output it adds to (a rotated side's, multiplied by Rᵀ after)

    @property
    def layout(self) -> list[int]:
        return self.side.layout + [int(getattr(self, name)) for name in SEGMENT_FIELDS]


def scores(queries: torch.Tensor, segments: list[Segment], mask: torch.Tensor | None, columns: int,
           limit: torch.Tensor, scaling: float) -> torch.Tensor:
    """queries [Q,B,H,G,D] → [B,H,G,S] scaled scores over S = `columns` columns held by `segments` (see
    `cache_scores`)."""
    return torch.ops.runner.cache_scores(queries.float().contiguous(), [t for s in segments for t in s.side.tensors],
                                         [n for s in segments for n in s.layout], mask, columns, limit, scaling)


def weighted(probs: torch.Tensor, segments: list[Segment], limit: torch.Tensor, outputs: int = 1) -> torch.Tensor:
    """probs [B,H,G,S] → [O,B,H,G,Dv], O = `outputs` (see `cache_weighted`)."""
    return torch.ops.runner.cache_weighted(probs.float().contiguous(), [t for s in segments for t in s.side.tensors],
                                           [n for s in segments for n in s.layout], outputs, limit)


def attend(query: torch.Tensor, keys: Side, values: Side, mask: torch.Tensor, scaling: float,
           limit: torch.Tensor) -> torch.Tensor:
    """One query column [B,H·G,1,D] over a whole cache, [B,S] bool `mask` (columns from `limit`, 0-d, never
    read) → [B,1,H·G,Dv] in the query's dtype, the G query heads of a KV head reading its columns once."""
    b, heads, _, dim = query.shape
    kv_heads, columns = keys.codes.shape[1], mask.shape[-1]
    rows = query.reshape(1, b, kv_heads, heads // kv_heads, dim)  # [1,B,H,G,D]
    probs = scores(rows, [Segment(keys)], mask, columns, limit, scaling).softmax(-1)  # [B,H,G,S]
    out = weighted(probs, [Segment(values)], limit)[0]  # [B,H,G,Dv]
    return out.reshape(b, 1, heads, values.dim).to(query.dtype)


def levels16(levels: torch.Tensor) -> torch.Tensor:
    """A store's levels as the kernel loads them: float32, padded with zeros to 16."""
    return torch.cat([levels.float(), levels.new_zeros(16 - levels.numel(), dtype=torch.float32)])
