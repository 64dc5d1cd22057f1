"""One-query attention over a CPU cache in its stored format: decode_attention.cpp, built once per machine with the
system's C++ compiler and called as two torch custom ops, so a compiled decode step calls them as opaque kernels.

Why a hand-written kernel: inductor's code for attention over a dequantized cache decodes every column once per
query head of its KV head (G = 3 on SmolLM2) and ends every column's product in its own horizontal sum; a packed
4-bit cache then decoded at 0.64–0.80× of fp16 at 4096 columns, KIVI at 0.22–0.40× (docs/performance.md). The
kernel decodes each column once into a float row (a few vector instructions, L1-resident) and takes it against
all G query heads; it reads fp32 / fp16 / bf16 caches the same way, so every kind is timed through the same code.
    cache_scores(queries, segments…)  [Q,B,H,G,D] → [B,H,G,S] scaled scores, -inf where no segment holds a
                                      column or the mask is 0
    cache_weighted(probs, segments…)  [B,H,G,S] → [O,B,H,G,Dv], columns whose probabilities are all 0 not read
A store is the tensors of one side (K or V) of a layer, [B,H,…] contiguous, and its `layout` (format, dim, bits,
group, plane, padded, outlier chunk): what `Store` tells the kernel. A segment is a store and the columns of the
call it holds, so KIVI's sinks, quantized region and full-precision ring are read in one call, under one softmax.
Outliers kept exact (KIVI's o option) are written over the decoded values of their column, as
kvcodes.restore_outliers writes them back.
Built by runner.infer.native (once per machine, under ~/.cache/runner/kernels); no compiler (or a failed build) →
`load()` is False and callers keep their torch expression of attention.
Owns: loading and calling the kernel. Knows nothing of cache classes, models or compilation.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.infer import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FORMATS = {"fp32": 0, "fp16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "nf4": 5, "q4_1": 6, "kivi_value": 7,
           "kivi_key": 8}
STORAGE_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
SEGMENT_FIELDS = ("start", "start_plus_limit", "stop", "stop_plus_limit", "base", "modulo", "query", "output")


class Store(ctypes.Structure):
    """decode_attention.cpp's `Store`: one side of a layer's cache as the kernel reads it."""

    _fields_ = [(name, ctypes.c_int64) for name in
                ("format", "dim", "bits", "group", "plane", "padded", "chunk", "count", "index_bytes")] + [
        ("codes", ctypes.c_void_p), ("codes_bh", ctypes.c_int64),
        ("scales", ctypes.c_void_p), ("scales_bh", ctypes.c_int64),
        ("mins", ctypes.c_void_p), ("mins_bh", ctypes.c_int64),
        ("outliers", ctypes.c_void_p), ("outliers_bh", ctypes.c_int64),
        ("index", ctypes.c_void_p), ("index_bh", ctypes.c_int64),
        ("levels", ctypes.c_void_p),
        ("blocks", ctypes.c_int64), ("group_shift", ctypes.c_int64), ("chunk_shift", ctypes.c_int64),
        ("uniform", ctypes.c_int64),
    ]


class _Segment(ctypes.Structure):
    """decode_attention.cpp's `Segment`: a store and the columns of the call it holds."""

    _fields_ = [("store", Store)] + [(name, ctypes.c_int64) for name in SEGMENT_FIELDS]


_LIBRARY: ctypes.CDLL | None = None  # set by `load`; read while tracing, so a plain global, not a cached call
_FAILED: list[str] = []  # why the build failed (tried once per process)


def load() -> bool:
    """Build (first time on this machine) and load the kernel; False when it cannot be (logged once). Called
    outside compiled code (a static cache's construction), so that `ready` is a global a trace can read."""
    global _LIBRARY
    if _LIBRARY is None and not _FAILED:
        try:
            library = ctypes.CDLL(str(native.build(SOURCE)))
        except (OSError, RuntimeError) as error:
            _FAILED.append(str(error))
            log.warning("CPU attention kernel unavailable, attention stays a torch expression: %s", error)
            return False
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        library.runner_scores.argtypes = [pointer, i64, pointer, pointer, i64, pointer, i64, i64, i64, i64, i64,
                                          ctypes.c_float, ctypes.c_int]
        library.runner_weighted.argtypes = [pointer, i64, i64, pointer, pointer, i64, i64, i64, i64, i64,
                                            ctypes.c_int]
        _LIBRARY = library
    return _LIBRARY is not None


def ready() -> bool:
    """The kernel is loaded (`load` succeeded)."""
    return _LIBRARY is not None


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
    return cache_scores(queries.float().contiguous(), [t for s in segments for t in s.side.tensors],
                        [n for s in segments for n in s.layout], mask, columns, limit, scaling)


def weighted(probs: torch.Tensor, segments: list[Segment], limit: torch.Tensor, outputs: int = 1) -> torch.Tensor:
    """probs [B,H,G,S] → [O,B,H,G,Dv], O = `outputs` (see `cache_weighted`)."""
    return cache_weighted(probs.float().contiguous(), [t for s in segments for t in s.side.tensors],
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


def _per_head(t: torch.Tensor | None, heads: int) -> tuple[int, int]:
    """(address, bytes from one (row, head) to the next) of contiguous [B,H,…] `t`; (0, 0) for None or an empty
    tensor."""
    if t is None or t.numel() == 0:
        return 0, 0
    if not t.is_contiguous():
        raise ValueError(f"cpu_attention reads contiguous tensors (got strides {t.stride()} for {list(t.shape)})")
    return t.data_ptr(), t.numel() // (t.shape[0] * heads) * t.element_size()


LAYOUT = 7 + len(SEGMENT_FIELDS)  # ints per segment in an op's `layouts`
_ARRAYS: dict[tuple, ctypes.Array] = {}  # `_segments`' answers: a static cache's addresses stay, so one per side


def _segments(tensors: list, layouts: list[int], heads: int, field: str, count: int) -> ctypes.Array:
    """The ops' flat arguments (6 tensors and LAYOUT ints per segment) as an array of `_Segment`s, each one's
    `field` (query: scores; output: weighted) checked to be below `count`. Kept by what determines it (addresses,
    shapes, strides, dtypes, layouts), so a decode step does not build or check its arrays again."""
    key = (heads, field, count, *layouts,
           *((t.data_ptr(), t.shape, t.stride(), t.dtype) if t is not None else None for t in tensors))
    if (array := _ARRAYS.get(key)) is not None:
        return array
    n = len(layouts) // LAYOUT
    if n < 1 or len(layouts) != n * LAYOUT or len(tensors) != 6 * n:
        raise ValueError(f"{n} segments: {len(tensors)} tensors and {len(layouts)} layout ints do not match")
    array = (_Segment * n)()
    for i, segment in enumerate(array):
        layout = layouts[i * LAYOUT:(i + 1) * LAYOUT]
        codes, scales, mins, outliers, index, levels = tensors[i * 6:(i + 1) * 6]
        store = segment.store
        store.format, store.dim, store.bits, store.group, store.plane, store.padded, store.chunk = layout[:7]
        store.blocks = store.padded // store.group if store.format == FORMATS["kivi_value"] else 0
        group, chunk = store.group, store.chunk
        store.group_shift, store.chunk_shift = _shift(group), _shift(chunk)
        store.count = 0 if outliers is None else outliers.shape[-1]
        store.index_bytes = 0 if index is None else index.element_size()
        store.codes, store.codes_bh = _per_head(codes, heads)
        store.scales, store.scales_bh = _per_head(scales, heads)
        store.mins, store.mins_bh = _per_head(mins, heads)
        store.outliers, store.outliers_bh = _per_head(outliers, heads)
        store.index, store.index_bh = _per_head(index, heads)
        if levels is not None and (levels.numel() != 16 or levels.dtype != torch.float32):
            raise ValueError("the kernel loads 16 float32 levels (two vectors of 8), used or not: see `levels16`")
        store.levels = _per_head(levels, 1)[0] if levels is not None else 0
        store.uniform = store.bits > 0 and levels is not None and bool(
            (levels[:2**store.bits] == torch.arange(2**store.bits, device=levels.device)).all())
        for name, value in zip(SEGMENT_FIELDS, layout[7:]):
            setattr(segment, name, value)
        if segment.modulo and segment.start < segment.base:  # a ring's columns past its base: (t − base) mod R ≥ 0
            raise ValueError(f"segment {i} is a ring starting at {segment.start}, before its base {segment.base}")
    _check_indices(layouts, field, count)
    if len(_ARRAYS) > 1024:  # caches come and go: forget all, the live ones are rebuilt once
        _ARRAYS.clear()
    _ARRAYS[key] = array
    return array


def _shift(n: int) -> int:
    """log2(n) for a power of 2, else -1 (the kernel divides)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def levels16(levels: torch.Tensor) -> torch.Tensor:
    """A store's levels as the kernel loads them: float32, padded with zeros to 16."""
    return torch.cat([levels.float(), levels.new_zeros(16 - levels.numel(), dtype=torch.float32)])


def _check_indices(layouts: list[int], field: str, count: int) -> None:
    """Every segment's `field` (query or output) below `count`: the kernel trusts them as offsets."""
    at = 7 + SEGMENT_FIELDS.index(field)
    if not all(0 <= value < count for value in layouts[at::LAYOUT]):
        raise ValueError(f"a segment's {field} is not below {count}: {layouts[at::LAYOUT]}")


@torch.library.custom_op("runner::cache_scores", mutates_args=())
def cache_scores(queries: torch.Tensor, tensors: list[torch.Tensor | None], layouts: list[int],
                 mask: torch.Tensor | None, columns: int, limit: torch.Tensor, scaling: float) -> torch.Tensor:
    """queries [Q,B,H,G,D] float32 → [B,H,G,S] scaling·q·K over S = `columns` columns, each read from the segment
    holding it (`tensors`: codes, scales, mins, outliers, index, levels of each; `layouts`: Segment.layout of
    each); -inf for columns no segment holds and where `mask` ([B,S'] bool; its last S columns are these) is False.
    `limit` (0-d) moves the segments' ends that say so."""
    _, b, heads, groups, _ = queries.shape
    out = queries.new_empty(b, heads, groups, columns)
    queries = queries.contiguous()
    segments = _segments(tensors, layouts, heads, "query", queries.shape[0])
    if mask is not None:
        if mask.shape[0] != b:
            raise ValueError(f"the mask has {mask.shape[0]} rows for {b} rows of queries")
        if mask.dtype != torch.bool or mask.stride(-1) != 1:
            mask = mask.bool().contiguous()
        mask = mask[:, -columns:]  # bool: one byte, 0 or 1, per column
    _LIBRARY.runner_scores(segments, len(segments), queries.data_ptr(), mask.data_ptr() if mask is not None else None,
                             mask.stride(0) if mask is not None else 0, out.data_ptr(), b, heads, groups, columns,
                             int(limit), scaling, torch.get_num_threads())
    return out


@cache_scores.register_fake
def _(queries, tensors, layouts, mask, columns, limit, scaling):
    return queries.new_empty(*queries.shape[1:4], columns)


@torch.library.custom_op("runner::cache_weighted", mutates_args=())
def cache_weighted(probs: torch.Tensor, tensors: list[torch.Tensor | None], layouts: list[int], outputs: int,
                   limit: torch.Tensor) -> torch.Tensor:
    """probs [B,H,G,S] float32 → [O,B,H,G,Dv]: output o is Σ probs·V over the columns of the segments whose
    `output` is o (arguments as `cache_scores`'s)."""
    b, heads, groups, columns = probs.shape
    out = probs.new_empty(outputs, b, heads, groups, layouts[1])
    probs = probs.contiguous()
    segments = _segments(tensors, layouts, heads, "output", outputs)
    _LIBRARY.runner_weighted(segments, len(segments), outputs, probs.data_ptr(), out.data_ptr(), b, heads, groups,
                               columns, int(limit), torch.get_num_threads())
    return out


@cache_weighted.register_fake
def _(probs, tensors, layouts, outputs, limit):
    return probs.new_empty(outputs, *probs.shape[:3], layouts[1])
