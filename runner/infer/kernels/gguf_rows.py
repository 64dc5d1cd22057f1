"""Few-row products on GGUF-quantized weights kept as stored: gguf_rows.cpp and gguf_kquants.cpp, registered as the
torch ops

    runner::gguf_rows(x float32 [M,K], blocks uint8 [N, row_bytes], ggml_type, path=0, interleaved=False)
        → float32 [M,N] = x · Wᵀ
    runner::gguf_interleave(blocks, ggml_type) → the same bytes with each span of 8 rows interleaved (Q4_0, Q4_1, Q5_0,
        N a multiple of 8), which gguf_rows(..., interleaved=True) reads 2.2× faster on AVX2 (in cache): 8 rows a vector
    runner::gguf_rows_group(x, [blocks…], ggml_type, path=0, interleaved=True) → [gguf_rows(x, blocks_i, …)…]
        (x quantized once, one parallel region; the native step calls it for q, k, v and gate, up; `group_products`
        rewrites a compiled graph's interleaved calls that share an x into it)
    runner::gguf_span_rows(blocks, ids int64 [R], ggml_type) → uint8 [R, row_bytes]: rows of interleaved blocks as
        the file stores them (an embedding's lookup; one op, not a gather inductor vectorizes: its AVX2 code read
        indices past what it loaded, 2026-11-27)
    runner::gguf_dequantize(blocks uint8 [R, row_bytes], ggml_type) → float32 [R,K]  (equal to gguf's dequantize)
    runner::gguf_paths() → the paths this build has (1 scalar, 2 AVX2 + FMA, 3 AVX-512: the 32-element types on
        512-bit registers, the K-quants and interleaved layouts their AVX2 code)

and the block formats' table (`GGML_TYPES`, `BLOCK_ELEMS`, `BLOCK_BYTES`, `row_bytes`).

Why: a decode step streams every weight once, so its speed is the rate at which weights are read; a GGUF model's
4–8-bit blocks are 4–8× fewer bytes than float32, and llama.cpp decodes from them directly. These kernels do its
arithmetic (x quantized once per call to q8_1 / q8_K, integer block dot products scaled by the block scales;
activation scales float32), so a model loaded from GGUF decodes from its stored bytes. Q8_0 alone quantizes x to
16 bits (the de-quantized model's greedy tokens, where 8-bit activations flipped near ties).
benchmarks/gguf_rows.py compares them with runner::linear_rows on the dequantized float32 weights.
Built by runner.infer.kernels.native (once per machine); no compiler or a failed build → `load()` is False.
Owns: loading the ops, their fake (tracing) implementations and the format table. Knows nothing of models or files.
"""

from __future__ import annotations

import operator

import torch

from runner.infer.kernels import native

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # ggml.h's enum ggml_type
BLOCK_ELEMS = {2: 32, 3: 32, 6: 32, 8: 32, 12: 256, 14: 256}  # elements of a block, by ggml type
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 8: 34, 12: 144, 14: 210}  # its bytes (ggml-common.h's block_* structs)
PATH_NAMES = {1: "scalar", 2: "avx2", 3: "avx512"}
_STATE: dict[str, bool] = {}


def load() -> bool:
    """Load runner's kernels (native.load) and register the ops' fakes for tracing (once)."""
    if "loaded" not in _STATE:
        _STATE["loaded"] = native.load()
        if _STATE["loaded"]:
            torch.library.register_fake("runner::gguf_rows")(_rows_fake)
            torch.library.register_fake("runner::gguf_dequantize")(_dequantize_fake)
            torch.library.register_fake("runner::gguf_interleave")(_interleave_fake)
            torch.library.register_fake("runner::gguf_rows_group")(_group_fake)
            torch.library.register_fake("runner::gguf_span_rows")(_span_rows_fake)
    return _STATE["loaded"]


def _rows_fake(x, blocks, ggml_type, path=0, interleaved=False):  # [M,N] float32
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


def _interleave_fake(blocks, ggml_type):  # the same shape, bytes reordered
    return torch.empty_like(blocks)


def _span_rows_fake(blocks, ids, ggml_type):  # [R, row_bytes] uint8
    return blocks.new_empty(ids.shape[0], blocks.shape[1])


def _group_fake(x, blocks, ggml_type, path=0, interleaved=True):  # [M,N_i] float32 each
    return [x.new_empty(x.shape[0], b.shape[0], dtype=torch.float32) for b in blocks]


def group_products(graph: torch.fx.Graph) -> int:
    """Inductor post-grad rewrite: the gguf_rows calls on interleaved weights of one type that read the same x (an
    attention's q, k and v; an MLP's gate and up) → one gguf_rows_group, which quantizes x once and shares all their
    rows between the threads in one parallel region (~0.7 ms of a SmolLM2 step). Only weights the graph takes as
    inputs (defined before any call), so the group can stand where its first call stood. Returns the groups made.
    Plain (not interleaved) weights are not grouped here: a graph with a plain Q8_0 group corrupted the heap before
    the group ran (glibc's malloc check, 2026-11-27; not understood), while the same calls outside a graph and in the
    native step are clean."""
    rows_op = torch.ops.runner.gguf_rows.default
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not rows_op:
            continue
        x, blocks, ggml_type, path, interleaved = _rows_args(node)
        weight_input = isinstance(blocks, torch.fx.Node) and blocks.op in ("placeholder", "get_attr")
        if interleaved and weight_input and isinstance(x, torch.fx.Node) and "val" in x.meta:
            groups.setdefault((_viewed(x), tuple(x.meta["val"].shape), ggml_type, path, interleaved), []).append(node)
    made = 0
    for (_, _, ggml_type, path, interleaved), nodes in groups.items():
        if len(nodes) < 2:
            continue
        with graph.inserting_before(nodes[0]):
            group = graph.call_function(torch.ops.runner.gguf_rows_group.default,
                                        (_rows_args(nodes[0])[0], [_rows_args(n)[1] for n in nodes], ggml_type, path,
                                         interleaved))
        group.meta["val"] = [node.meta["val"] for node in nodes]
        for i, node in enumerate(nodes):
            with graph.inserting_before(node):
                part = graph.call_function(operator.getitem, (group, i))
            part.meta.update(node.meta)
            node.replace_all_uses_with(part)
            graph.erase_node(node)
        made += 1
    return made


def _rows_args(node: torch.fx.Node) -> tuple:
    """A gguf_rows node's (x, blocks, ggml_type, path, interleaved), defaults filled in."""
    x, blocks, ggml_type, path, interleaved = (*node.args, 0, False)[:5]
    return x, blocks, ggml_type, node.kwargs.get("path", path), node.kwargs.get("interleaved", interleaved)


def _viewed(node: torch.fx.Node) -> torch.fx.Node:
    """The node a chain of views reads (each Linear reshapes the same hidden state on its own)."""
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    while node.op == "call_function" and node.target in views and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _dequantize_fake(blocks, ggml_type):  # [R,K] float32
    elements = blocks.shape[1] // BLOCK_BYTES[ggml_type] * BLOCK_ELEMS[ggml_type]
    return blocks.new_empty(blocks.shape[0], elements, dtype=torch.float32)


INTERLEAVED_TYPES = (GGML_TYPES["Q4_0"], GGML_TYPES["Q4_1"], GGML_TYPES["Q5_0"])  # the types gguf_interleave reorders
INTERLEAVED_ROWS = 8


def interleavable(ggml_type: int, rows: int) -> bool:
    """Whether gguf_interleave takes a tensor of this type and row count."""
    return ggml_type in INTERLEAVED_TYPES and rows % INTERLEAVED_ROWS == 0


def paths() -> dict[int, str]:
    """The paths this build has, by number, with their names ({1: "scalar", 2: "avx2"} on an AVX2 CPU); {} when
    the kernels are not loaded."""
    if not load():
        return {}
    return {path: PATH_NAMES[path] for path in torch.ops.runner.gguf_paths()}


def type_number(ggml_type: int | str) -> int:
    """A ggml type by name ("Q4_K") or number (12) → its number; ValueError for one these kernels do not read."""
    number = GGML_TYPES.get(ggml_type, -1) if isinstance(ggml_type, str) else int(ggml_type)
    if number not in BLOCK_ELEMS:
        raise ValueError(f"ggml type {ggml_type!r} is not one gguf_rows reads ({', '.join(GGML_TYPES)})")
    return number


def row_bytes(ggml_type: int | str, k: int) -> int:
    """Bytes of a row of `k` elements in `ggml_type`; ValueError when k is not a whole number of blocks."""
    number = type_number(ggml_type)
    if k % BLOCK_ELEMS[number]:
        raise ValueError(f"{k} elements are not a whole number of blocks of {BLOCK_ELEMS[number]}")
    return k // BLOCK_ELEMS[number] * BLOCK_BYTES[number]
