"""Few-row products on runner's own CPU kernel: linear_rows.cpp, registered as the torch op runner::linear_rows, and
`OwnProducts`, the inductor pass that puts it in a compiled decode step in place of aten's mm.

Why: a decode step at a small batch is a chain of few-row products that stream every weight once, and aten's
one-row product reads weights well below the machine's copy bandwidth; this kernel reads them faster
(benchmarks/linear_rows.py; figures in docs/performance.md). The pass rewrites, in the graph inductor
is about to lower,
    mm(x [M,K], wt [K,N])  and  addmm(bias, x, wt)
where M ≤ MAX_ROWS (8 in float32, 4 in bfloat16; 16 in bfloat16 on the AMX path: `rows_served`), both float32
or both bfloat16, and wt is a row-major weight seen transposed (an nn.Linear's weight as stored: strides (1, K))
into runner::linear_rows(x, wt, bias). Everything else (longer feeds, batches past those, fp16, torchao's
quantized weights, an input-major weight) stays aten's. The op is a C++ op, so a call costs what aten's does
(about 6 µs from the generated wrapper; a Python custom op cost 20–30).
Built by runner.infer.kernels.native (once per machine); no compiler, a failed build or a CPU without AVX2 and FMA →
`load()` is False, and the compiled step keeps aten's products.
Owns: loading the op and the pass. Knows nothing of models, caches or engines.
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from runner.infer.kernels import gguf_rows, native

log = logging.getLogger(__name__)

MAX_ROWS = {torch.float32: 8, torch.bfloat16: 4}  # past 4 rows aten's bfloat16 product was as fast (linear_rows.py)
AMX_ROWS = 16  # bfloat16 rows on the AMX path (a tile's height), for the shapes it takes (linear_rows_amx)
_STATE: dict[str, bool] = {}


def load() -> bool:
    """Load runner's kernels (native.load) and say whether the product is used here: only where it is vectorized
    (AVX2 and FMA; logged once where not)."""
    if "usable" not in _STATE:
        loaded = native.load()
        _STATE["usable"] = loaded and bool(torch.ops.runner.linear_rows_vectorized())
        if loaded:
            torch.library.register_fake("runner::linear_rows")(_fake)
            if not _STATE["usable"]:
                log.warning("runner's product kernel has no AVX2/FMA build on this CPU: products stay aten's")
    return _STATE["usable"]


def _fake(x, wt, bias, widest=True):  # the op's output for tracing: [M,N] in x's dtype
    return x.new_empty(x.shape[0], wt.shape[1])


def _takes(x, wt) -> bool:
    """Whether linear_rows serves mm(x, wt): few rows, one supported dtype on CPU, wt a row-major weight's view."""
    if not (x.dim() == 2 and wt.dim() == 2 and x.device.type == "cpu" and wt.device.type == "cpu"):
        return False
    rows, inner = x.shape
    return (isinstance(rows, int) and 1 <= rows <= rows_served(x.dtype, inner, wt.shape[1]) and x.dtype == wt.dtype
            and tuple(wt.stride()) == (1, inner))


def rows_served(dtype: torch.dtype, inner: int, outer: int) -> int:
    """The most rows of x the pass gives linear_rows for a [outer, inner] weight: MAX_ROWS, or AMX_ROWS for bfloat16
    where the kernel's AMX path runs that shape (runner::linear_rows_amx: the CPU's tiles, granted; whole tiles).
    There one weight tile multiplies all 16 rows, so 16 rows read the weights about as fast as one: 1.85× aten's
    bfloat16 product at 16 rows on SmolLM2's weights (benchmarks/linear_rows.py, docs/performance.md)."""
    if (dtype == torch.bfloat16 and isinstance(inner, int) and isinstance(outer, int) and load()
            and torch.ops.runner.linear_rows_amx(inner, outer)):
        return AMX_ROWS
    return MAX_ROWS.get(dtype, 0)


class OwnProducts(CustomGraphPass):
    """Inductor's post-grad pass: few-row mm/addmm on row-major weights → runner::linear_rows, then GGUF products
    that share an x → one runner::gguf_rows_group (gguf_rows.group_products). `replaced` and `grouped` count what
    it rewrote in the graphs it saw (what the tests read)."""

    replaced = 0
    grouped = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if node.target is aten.addmm.default:
                if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                    continue
                bias, x, wt = node.args
            else:
                (x, wt), bias = node.args, None
            x_val, wt_val = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (x, wt))
            if x_val is None or wt_val is None or not _takes(x_val, wt_val):
                continue
            shift = bias.meta.get("val") if bias is not None else None
            if bias is not None and (shift is None or shift.dim() != 1 or shift.dtype != x_val.dtype
                                     or shift.stride() != (1,)):
                continue  # the op takes a bias as a Linear has it: [N] contiguous, in x's dtype
            with graph.inserting_before(node):
                product = graph.call_function(torch.ops.runner.linear_rows.default, (x, wt, bias))
            product.meta.update(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
            OwnProducts.replaced += 1
        if gguf_rows.load():
            OwnProducts.grouped += gguf_rows.group_products(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, gguf_rows.__file__, *map(str, native.SOURCES)))
