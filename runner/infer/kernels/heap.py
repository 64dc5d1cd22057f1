"""The process heap on CPU: glibc's malloc kept from handing a forward's activations back to the kernel between layers,
and a model's weights placed on transparent huge pages.

A forward frees and allocates the same tens of MiB every layer (a 2,048-token Qwen2.5-Coder-0.5B layer: its gate, up
and their product, 20 MiB each). glibc returns such blocks to the kernel, by munmap above its mmap threshold or by
trimming the heap's top above its trim threshold, and both thresholds move with the history of earlier frees; the
next layer then faults the pages back in, zeroed. Measured in one process and not in the next, the same forward:
350,000 page faults and 0.68 s of system time a step, 1.74 s against 1.30 s. keep() fixes both thresholds (the
mmap threshold at glibc's largest, 32 MiB; the heap never trimmed), so a figure no longer depends on what a process
happened to free first; release() hands the free memory back (malloc_trim) before a peak-RSS measurement starts, so
that peak is the measured block's.

Both do nothing where malloc is not glibc's, and keep() leaves alone a process whose MALLOC_*_THRESHOLD_ variables
say how its heap should behave.

onto_huge_pages() copies a model's weights into one anonymous mapping advised for huge pages (madvise
MADV_HUGEPAGE; Linux's default THP setting, `madvise`, gives them to no other memory). A decode step streams every
weight once, and on 4 KiB pages each 4 KiB read misses the TLB: under a hypervisor's nested paging that walk is what
bounds the read. A 2-core Xeon with AMX (KVM), Qwen2.5-Coder-0.5B bf16, its products at 16 rows in one process
(benchmarks/linear_rows.py, "4k" column): 62.0 ms on huge pages, 200.1 on 4 KiB pages; across runs the huge-page
figure stayed at 52–62 ms while the 4 KiB one moved between 88 and 408. layers_onto_huge_pages() does the same for
a static KV cache's tensors, which a step writes a column of in every row and head and reads whole.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest on 64-bit: blocks above it are still mapped and unmapped
NEVER_TRIM_BYTES = 2**31 - 1  # mallopt takes an int
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
_STATE: dict[str, bool] = {}
HUGE_PAGE_BYTES = 2 * 2**20  # x86-64's transparent huge page
ALIGN_BYTES = 64  # each storage's start in the mapping, as torch's CPU allocator aligns
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"  # "always [madvise] never": the bracketed one is in force


@functools.cache
def _glibc() -> ctypes.CDLL | None:  # the process's C library, once
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
        return libc
    except (OSError, AttributeError):
        return None


def keep() -> bool:
    """Fix glibc's thresholds for this process (once); True when they are fixed."""
    if "kept" not in _STATE:
        libc = _glibc()
        if libc is None or any(name in os.environ for name in USER_SETTINGS):
            _STATE["kept"] = False
        else:
            _STATE["kept"] = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                              and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_BYTES) == 1)
            log.debug("glibc heap: mmap threshold %d MiB, never trimmed: %s", MMAP_THRESHOLD_BYTES >> 20,
                      _STATE["kept"])
    return _STATE["kept"]


def release() -> None:
    """Give the heap's free memory back to the kernel (malloc_trim), e.g. before a peak-RSS measurement."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def huge_pages_allowed() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks (THP `always` or `madvise`)."""
    try:
        with open(THP_SETTING) as file:
            return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in file.read()
    except OSError:
        return False


def onto_huge_pages(model: torch.nn.Module, huge: bool = True) -> int:
    """Copy `model`'s CPU parameters and buffers into one mapping advised for huge pages, each tensor keeping its
    values, shape, strides and ties (tensors of one storage stay views of one copy, of the bytes they use); returns
    the bytes placed, 0 where the system has no transparent huge pages or the weights are smaller than one. Tensor
    subclasses (torchao's) stay. huge=False advises 4 KiB pages instead: what a benchmark compares against."""
    places = ((table, name, tensor) for module in model.modules() for table in (module._parameters, module._buffers)
              for name, tensor in table.items())
    return _onto_huge_pages(places, huge, "weights", logging.INFO)


def layers_onto_huge_pages(layers: list, huge: bool = True) -> int:
    """Copy a KV cache's layers' tensors (each layer's TENSORS: the K/V, codes and scales it holds) into one mapping
    advised for huge pages, as onto_huge_pages does a model's weights. A decode step writes one column of every row
    and head (on 4 KiB pages, a page each) and reads every row's held columns: a 16-row Qwen2.5-Coder-0.5B step at
    140 columns of context, on the same Xeon, 70.1 ms with its cache on huge pages against 74.9 on 4 KiB pages (p90
    79.5 against 103.0; docs/performance.md, "The KV cache on huge pages")."""
    places = ((vars(layer), name, getattr(layer, name)) for layer in layers for name in layer.TENSORS)
    return _onto_huge_pages(places, huge, "KV cache", logging.DEBUG)


def _onto_huge_pages(places: Iterator[tuple[dict[str, Any], str, Any]], huge: bool, what: str, level: int) -> int:
    """Each (table, name, tensor) of `places` (a module's _parameters or _buffers, or an object's vars) onto one
    mapping advised for huge pages (`huge`) or 4 KiB pages: onto_huge_pages' copy, logged at `level`. The old
    copies are given back to the kernel once none of them is held here."""
    if not huge_pages_allowed():
        return 0
    moving: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    spans: dict[int, tuple[int, int]] = {}  # a storage's data_ptr → the bytes [low, high) its tensors use
    seen: set[int] = set()
    for table, name, tensor in places:
        if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or type(tensor.data) is not torch.Tensor
                or id(tensor) in seen or tensor.numel() == 0):  # a tied Parameter: moved once
            continue
        moving.append((table, name, tensor))
        if isinstance(tensor, torch.nn.Parameter):
            seen.add(id(tensor))
        first, size = int(tensor.storage_offset()), tensor.element_size()  # in elements; bytes an element
        last = first + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))
        first_byte, end_byte = first * size, (last + 1) * size
        pointer = tensor.untyped_storage().data_ptr()
        low, high = spans.get(pointer, (first_byte, end_byte))
        spans[pointer] = (min(low, first_byte) // ALIGN_BYTES * ALIGN_BYTES, max(high, end_byte))
    offsets, total = {}, 0  # a storage's data_ptr → where its span starts in the mapping
    for pointer, (low, high) in spans.items():
        offsets[pointer] = total
        total += -(-(high - low) // ALIGN_BYTES) * ALIGN_BYTES
    if total < HUGE_PAGE_BYTES:
        return 0
    mapping = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)  # before the copy faults the pages in
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any tensor of it
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # the tensors from a huge page's boundary
    copied: set[int] = set()
    with torch.no_grad():
        for table, name, tensor in moving:
            pointer = tensor.untyped_storage().data_ptr()
            low, high = spans[pointer]
            at = start + offsets[pointer] - low  # the mapping's byte for the storage's byte 0
            if pointer not in copied:
                old = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
                raw[at + low:at + high].copy_(old[low:high])
                copied.add(pointer)
            moved = torch.empty(0, dtype=tensor.dtype).set_(
                raw.untyped_storage(), at // tensor.element_size() + tensor.storage_offset(), tensor.shape,
                tensor.stride())
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = moved  # the same Parameter object: ties between modules and references stay
            else:
                table[name] = moved
    del moving, tensor, old
    release()  # the old copies' memory: the kept heap would hold it
    if log.isEnabledFor(level):  # smaps is read only to say so: a cache is made at every compiled state
        granted = int(mapping_of(raw.data_ptr()).get("AnonHugePages", "0 kB").split()[0]) * 1024
        log.log(level, "%s on huge pages: %.0f of %.0f MiB", what, granted / 2**20, total / 2**20)
    return total


def mapping_of(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds `address` (e.g. AnonHugePages: "2048 kB", VmFlags: "rd wr
    mr mw me ac hg"); {} where none does, or the file cannot be read."""
    fields: dict[str, str] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                key, _, value = line.partition(" ")
                if not key.endswith(":"):  # a mapping's first line: "start-end perms offset dev inode path"
                    if inside:
                        break
                    start, end = (int(x, 16) for x in key.split("-"))
                    inside = start <= address < end
                elif inside:
                    fields[key[:-1]] = value.strip()
    except OSError:
        return {}
    return fields
