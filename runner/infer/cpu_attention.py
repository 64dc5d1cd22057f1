"""One-query attention over a CPU cache in its stored format: decode_attention.cpp, built once per machine with the
system's C++ compiler and called as two torch custom ops, so a compiled decode step calls them as opaque kernels.

Why a hand-written kernel: inductor's code for attention over a dequantized cache decodes every column once per
query head of its KV head (G = 3 on SmolLM2) and ends every column's product in its own horizontal sum; a packed
4-bit cache then decoded at 0.64–0.80× of fp16 at 4096 columns, KIVI at 0.22–0.40× (docs/performance.md). The
kernel decodes each column once into a float row (a few vector instructions, L1-resident) and takes it against
all G query heads; it reads fp32 / fp16 / bf16 caches the same way, so every kind is timed through the same code.
    cache_scores(query, store…)    [B,H,G,D] → [B,H,G,S] scaled scores, -inf past `limit` or where the mask is 0
    cache_weighted(probs, store…)  [B,H,G,S] → [B,H,G,Dv], columns whose probabilities are all 0 not read
A store is the tensors of one side (K or V) of a layer, [B,H,…] contiguous, and its `layout` (format, dim, bits,
group, plane, padded, outlier chunk): what `Store` tells the kernel. Outliers kept exact (KIVI's o option) are
written over the decoded values of their column, as kvcodes.restore_outliers writes them back.
The build goes to ~/.cache/runner/kernels/<hash>.so, the hash covering the source, the flags and this CPU; no
compiler (or a failed build) → `load()` is False and callers keep their torch expression of attention.
Owns: building, loading and calling the kernel. Knows nothing of cache classes, models or compilation.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.files import atomic_write

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
KERNEL_DIR = Path.home() / ".cache" / "runner" / "kernels"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
FORMATS = {"fp32": 0, "fp16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "nf4": 5, "q4_1": 6, "kivi_value": 7,
           "kivi_key": 8}
STORAGE_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


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
    ]


def _machine() -> str:
    """What -march=native compiles for: the CPU's model and flags (a home directory shared by other CPUs
    gets one build each)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or $CXX) found")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(),
                                        _machine().encode()])).hexdigest()[:16]
    target = KERNEL_DIR / f"decode_attention-{digest}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / "decode_attention.so"
        run = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{run.stderr[-2000:]}")
        atomic_write(target, built.read_bytes())
    log.info("built %s", target)
    return target


_LIBRARY: ctypes.CDLL | None = None  # set by `load`; read while tracing, so a plain global, not a cached call
_FAILED: list[str] = []  # why the build failed (tried once per process)


def load() -> bool:
    """Build (first time on this machine) and load the kernel; False when it cannot be (logged once). Called
    outside compiled code (a static cache's construction), so that `ready` is a global a trace can read."""
    global _LIBRARY
    if _LIBRARY is None and not _FAILED:
        try:
            library = ctypes.CDLL(str(_build()))
        except (OSError, RuntimeError) as error:
            _FAILED.append(str(error))
            log.warning("CPU attention kernel unavailable, attention stays a torch expression: %s", error)
            return False
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        library.runner_scores.argtypes = [ctypes.POINTER(Store), pointer, pointer, i64, pointer, i64, i64, i64, i64,
                                          i64, ctypes.c_float, ctypes.c_int]
        library.runner_weighted.argtypes = [ctypes.POINTER(Store), pointer, pointer, i64, i64, i64, i64, i64,
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
    def tensors(self) -> tuple:
        return self.codes, self.scales, self.mins, self.outliers, self.index, self.levels

    @property
    def layout(self) -> list[int]:
        return [FORMATS[self.format], self.dim, self.bits, self.group, self.plane, self.padded, self.chunk]


def scores(query: torch.Tensor, keys: Side, mask: torch.Tensor | None, columns: int, limit: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """query [B,H,G,D] → [B,H,G,S] scaled scores over the S = `columns` columns of `keys` (see `cache_scores`)."""
    return cache_scores(query.float().contiguous(), *keys.tensors, mask, keys.layout, columns, limit, scaling)


def weighted(probs: torch.Tensor, values: Side, limit: torch.Tensor) -> torch.Tensor:
    """probs [B,H,G,S] → [B,H,G,Dv] (see `cache_weighted`)."""
    return cache_weighted(probs.float().contiguous(), *values.tensors, values.layout, limit)


def attend(query: torch.Tensor, keys: Side, values: Side, mask: torch.Tensor, scaling: float,
           limit: torch.Tensor) -> torch.Tensor:
    """One query column [B,H·G,1,D] over a whole cache, [B,S] bool `mask` (columns from `limit`, 0-d, never
    read) → [B,1,H·G,Dv] in the query's dtype, the G query heads of a KV head reading its columns once."""
    b, heads, _, dim = query.shape
    kv_heads, columns = keys.codes.shape[1], mask.shape[-1]
    rows = query.reshape(b, kv_heads, heads // kv_heads, dim)  # [B,H,G,D]
    probs = scores(rows, keys, mask, columns, limit, scaling).softmax(-1)  # [B,H,G,S]
    out = weighted(probs, values, limit)  # [B,H,G,Dv]
    return out.reshape(b, 1, heads, values.dim).to(query.dtype)


def _per_head(t: torch.Tensor | None, heads: int, keep: list) -> tuple[int, int]:
    """(address, bytes from one (row, head) to the next) of [B,H,…] `t` made contiguous (the copy, if any, kept
    alive in `keep`); (0, 0) for None or an empty tensor."""
    if t is None or t.numel() == 0:
        return 0, 0
    t = t.contiguous()
    keep.append(t)
    return t.data_ptr(), t.numel() // (t.shape[0] * heads) * t.element_size()


def _store(layout: list[int], heads: int, codes, scales, mins, outliers, index, levels, keep: list) -> Store:
    fmt, dim, bits, group, plane, padded, chunk = layout
    store = Store(format=fmt, dim=dim, bits=bits, group=group, plane=plane, padded=padded, chunk=chunk,
                  count=0 if outliers is None else outliers.shape[-1],
                  index_bytes=0 if index is None else index.element_size())
    store.codes, store.codes_bh = _per_head(codes, heads, keep)
    store.scales, store.scales_bh = _per_head(scales, heads, keep)
    store.mins, store.mins_bh = _per_head(mins, heads, keep)
    store.outliers, store.outliers_bh = _per_head(outliers, heads, keep)
    store.index, store.index_bh = _per_head(index, heads, keep)
    if levels is not None and levels.numel() < 16:  # the kernel loads 16 levels (two vectors of 8), used or not
        levels = torch.cat([levels, levels.new_zeros(16 - levels.numel())])
    store.levels = _per_head(levels, 1, keep)[0] if levels is not None else 0
    return store


@torch.library.custom_op("runner::cache_scores", mutates_args=())
def cache_scores(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
                 outliers: torch.Tensor | None, index: torch.Tensor | None, levels: torch.Tensor | None,
                 mask: torch.Tensor | None, layout: list[int], columns: int, limit: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """query [B,H,G,D] float32 → [B,H,G,S] scaling·q·K over the store's S = `columns` columns; -inf past
    `limit` (0-d) and where `mask` ([B,S'] bool; its last S columns are these) is False."""
    b, heads, groups, _ = query.shape
    out = query.new_empty(b, heads, groups, columns)
    keep: list = [query := query.contiguous()]
    store = _store(layout, heads, codes, scales, mins, outliers, index, levels, keep)
    mask_bytes = mask[:, -columns:].to(torch.uint8).contiguous() if mask is not None else None
    _LIBRARY.runner_scores(ctypes.byref(store), query.data_ptr(),
                             mask_bytes.data_ptr() if mask_bytes is not None else None,
                             columns, out.data_ptr(), b, heads, groups, columns, int(limit), scaling,
                             torch.get_num_threads())
    return out


@cache_scores.register_fake
def _(query, codes, scales, mins, outliers, index, levels, mask, layout, columns, limit, scaling):
    return query.new_empty(*query.shape[:3], columns)


@torch.library.custom_op("runner::cache_weighted", mutates_args=())
def cache_weighted(probs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
                   outliers: torch.Tensor | None, index: torch.Tensor | None, levels: torch.Tensor | None,
                   layout: list[int], limit: torch.Tensor) -> torch.Tensor:
    """probs [B,H,G,S] float32 → [B,H,G,Dv] Σ probs·V over the columns below `limit` (0-d)."""
    b, heads, groups, columns = probs.shape
    out = probs.new_empty(b, heads, groups, layout[1])
    keep: list = [probs := probs.contiguous()]
    store = _store(layout, heads, codes, scales, mins, outliers, index, levels, keep)
    _LIBRARY.runner_weighted(ctypes.byref(store), probs.data_ptr(), out.data_ptr(), b, heads, groups, columns,
                               int(limit), torch.get_num_threads())
    return out


@cache_weighted.register_fake
def _(probs, codes, scales, mins, outliers, index, levels, layout, limit):
    return probs.new_empty(*probs.shape[:3], layout[1])
