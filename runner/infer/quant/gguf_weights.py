"""A GGUF model's quantized tensors kept as the file stores them (`model.quantization: gguf`), read by runner's block
kernels (runner.infer.kernels.gguf_rows) instead of being de-quantized to float at load.

    keep_gguf_formats(model, path)   the model (loaded from that file, de-quantized by transformers), its Linears and
                                     input embedding swapped in place for GGUFLinear / GGUFEmbedding over the file's
                                     blocks; returns {ggml type name: tensors kept}

Why: the zoo's models are GGUF files at 4-5 bits; de-quantized they are four to eight times larger in memory than
what users deploy, and every speed verdict is then about a model no one runs. Kept as stored, the weights' measured
bytes are the file's and a decode step reads what llama.cpp reads, with llama.cpp's arithmetic (activations
quantized to 8 bits per block, integer block products).

Which tensor is which module: transformers' own GGUF name map (get_gguf_hf_weights_map) and tensor processor (the
row permutation llama.cpp applies to q and k is undone on whole rows of blocks, found by running the processor on
row numbers). Every kept tensor is checked against the model's de-quantized weight on sample rows, exactly: a map
that went wrong is an error, never a wrong model. A head the file stores apart (Qwen's output.weight) is kept apart;
a tied one reads the embedding's blocks. Types the kernels do not read stay the float weights transformers made
(logged).
Owns: the modules and the swap. Knows nothing of manifests, caches or engines.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from runner.errors import ModelError
from runner.infer.kernels import gguf_rows
from runner.infer.quant.gguf_tensors import gguf_tensors, tensor_blocks

log = logging.getLogger(__name__)

TYPE_NAMES = {number: name for name, number in gguf_rows.GGML_TYPES.items()}  # the types the kernels read
CHECKED_ROWS = 4  # rows per tensor compared exactly with the de-quantized weight (first, last, two between)
DEQUANTIZE_ROWS = 64  # rows of x from which a plain (not interleaved) tensor is de-quantized and multiplied in float


def _product(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, kernels: bool, interleaved: bool) -> torch.Tensor:
    """x [M,K] float32 · W [N,K]ᵀ with W as blocks uint8 [N, row bytes] → [M,N] float32 (interleaved: in the
    kernels' 8-row spans, gguf_rows.interleavable). From DEQUANTIZE_ROWS rows of x on (a prompt), W de-quantized
    once and multiplied in float is faster than the few-row kernel, which decodes every block again for each 4
    rows of x (docs/performance.md); a decode step's few rows keep the kernel."""
    if kernels and (x.shape[0] < DEQUANTIZE_ROWS or interleaved):
        return torch.ops.runner.gguf_rows(x, blocks, ggml_type, 0, interleaved)
    return x @ _rows(blocks, ggml_type, kernels).t()


def _rows(blocks: torch.Tensor, ggml_type: int, kernels: bool) -> torch.Tensor:
    """Rows of blocks uint8 [R, row bytes] → float32 [R,K]."""
    if kernels:
        return torch.ops.runner.gguf_dequantize(blocks, ggml_type)
    return _dequantized(blocks, ggml_type)


@torch.compiler.disable
def _dequantized(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Without runner's kernels (no compiler): the gguf package's numpy de-quantization (slow, exact)."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type)).copy())


class GGUFLinear(torch.nn.Module):
    """y = x·Wᵀ (+ bias) with W a GGUF tensor as stored: `weight` uint8 [N, row bytes] of one ggml type (a frozen
    Parameter, so the model's parameters and measured bytes hold it). Computes in float32; y in x's dtype.
    `interleaved`: the weight's bytes are in the kernels' 8-row spans (see `interleaved`)."""

    def __init__(self, weight: torch.nn.Parameter, ggml_type: int, in_features: int,
                 bias: torch.nn.Parameter | None = None, interleaved: bool = False):
        super().__init__()
        self.kernels = gguf_rows.load()  # loaded here, never while a compiled step is traced (a graph break)
        self.weight, self.bias, self.interleaved = weight, bias, interleaved
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [...,K] → [...,N]
        rows = x.reshape(-1, self.in_features).to(torch.float32)  # [M,K]
        y = _product(rows, self.weight, self.ggml_type, self.kernels, self.interleaved)  # [M,N]
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={TYPE_NAMES[self.ggml_type]}, bias={self.bias is not None}, interleaved={self.interleaved}")


class GGUFEmbedding(torch.nn.Module):
    """An input embedding read from a GGUF tensor as stored: gather the ids' rows of blocks, de-quantize them.
    `interleaved`: the blocks are in the kernels' 8-row spans (a tied head reads them so): an id's row is read back
    from its span by runner::gguf_span_rows."""

    def __init__(self, weight: torch.nn.Parameter, ggml_type: int, embedding_dim: int, dtype: torch.dtype,
                 embed_scale: torch.Tensor | float | None = None, interleaved: bool = False):
        super().__init__()
        self.weight, self.ggml_type, self.embedding_dim, self.dtype = weight, ggml_type, embedding_dim, dtype
        self.num_embeddings = weight.shape[0]
        self.kernels = gguf_rows.load()
        self.embed_scale = embed_scale  # models that scale their embeddings (Gemma) keep doing so
        self.interleaved = interleaved

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B,T] → [B,T,D]
        flat = ids.reshape(-1)  # [R]
        if self.interleaved:  # [R, row bytes], as the file stores them
            blocks = torch.ops.runner.gguf_span_rows(self.weight, flat, self.ggml_type)
        else:
            blocks = self.weight[flat]
        rows = _rows(blocks, self.ggml_type, self.kernels).to(self.dtype)  # [R,D]
        rows = rows.reshape(*ids.shape, self.embedding_dim)
        return rows if self.embed_scale is None else rows * self.embed_scale


# --- the swap -------------------------------------------------------------------------------------------------------

def keep_gguf_formats(model, path: Path) -> dict[str, int]:
    """Swap `model`'s Linears and input embedding for modules over `path`'s blocks where the kernels read the
    tensor's type (see the module docstring); {type name: tensors kept}. ModelError when the file is not the one the
    model was loaded from."""
    tensors = gguf_tensors(path)
    hf_to_gguf = _gguf_names(model)
    processor = _processor(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    modules = dict(model.named_modules())
    embedding_name = next(name for name, module in modules.items() if module is embedding)
    kept: Counter[str] = Counter()
    left: Counter[str] = Counter()
    shared: dict[str, torch.nn.Parameter] = {}  # gguf tensor name → its Parameter (a tied head reads the embedding's)
    for name, module in modules.items():
        if not (module is embedding or isinstance(module, torch.nn.Linear)):
            continue
        source = embedding_name if module is head and tied else name  # a tied head has no tensor of its own
        tensor = tensors.get(hf_to_gguf.get(f"{source}.weight", ""))
        if tensor is None:
            continue
        ggml_type, type_name = tensor.ggml_type, tensor.type_name
        if ggml_type not in TYPE_NAMES:
            left[type_name] += 1
            continue
        weight = shared.get(tensor.name)
        in_spans = interleaved(ggml_type, module.weight.shape[0])  # its rows: the file's (_check), the shared one's
        if weight is None:
            blocks = torch.from_numpy(_hf_rows(tensor_blocks(path, tensor), tensor.name, processor))
            _check(blocks.numpy(), ggml_type, module.weight, f"{path.name}: {tensor.name} → {name}")
            if in_spans:  # the kernels read it 8 rows at a time: the same bytes
                blocks = torch.ops.runner.gguf_interleave(blocks, ggml_type)
            weight = shared[tensor.name] = torch.nn.Parameter(blocks, requires_grad=False)
            kept[type_name] += 1
        if module is embedding:
            model.set_input_embeddings(GGUFEmbedding(weight, ggml_type, module.weight.shape[1], module.weight.dtype,
                                                     getattr(module, "embed_scale", None), in_spans))
        else:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, GGUFLinear(weight, ggml_type, module.in_features, module.bias,
                                                                   in_spans))
    if left:
        log.warning("%s: tensors of types the kernels do not read stay float: %s", path.name,
                    ", ".join(f"{n}×{t}" for t, n in sorted(left.items())))
    if not kept:
        raise ModelError(f"model.quantization: gguf: {path.name} has no tensor in a format runner's kernels read "
                         f"({', '.join(TYPE_NAMES.values())}); use quantization: none")
    log.info("%s kept as stored: %s", path.name, ", ".join(f"{n} {t}" for t, n in sorted(kept.items())))
    return dict(kept)


def interleaved(ggml_type: int, rows: int) -> bool:
    """Whether a kept tensor is stored in the kernels' 8-row spans: where they read its type so (Q4_0, Q4_1, Q5_0),
    for a Linear, an embedding and a tied head alike."""
    return gguf_rows.load() and gguf_rows.interleavable(ggml_type, rows)


def _gguf_names(model) -> dict[str, str]:
    """The model's parameter name → its GGUF tensor name, by the gguf package's table for the architecture (what
    transformers' get_gguf_hf_weights_map reads, without its walk over every submodule: 8 s on SmolLM2)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_type = _gguf_architecture(model)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model_type), None)
    if arch is None:
        raise ModelError(f"model.quantization: gguf: the gguf package has no tensor names for {model_type}")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for name in model.state_dict():
        stem, dot, suffix = name.rpartition(".")
        gguf_name = table.get_name(stem)
        if gguf_name is not None:
            names[name] = f"{gguf_name}{dot}{suffix}"
    return names


def _gguf_architecture(model) -> str:
    return model.config.model_type.removesuffix("_text")  # gemma3_text's GGUF architecture is gemma3


def _processor(model):
    """transformers' tensor processor for the model's architecture (it undoes llama.cpp's q/k row permutation)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(_gguf_architecture(model), TensorProcessor)(config=model.config.to_dict())


def _hf_rows(blocks: np.ndarray, name: str, processor) -> np.ndarray:
    """The file's rows of blocks [N, row bytes] in the model's row order: the processor's permutation of whole
    rows, found by processing the row numbers."""
    order = processor.process(np.arange(blocks.shape[0]).reshape(-1, 1), name).weights.reshape(-1)
    return np.ascontiguousarray(blocks[order])


def _check(blocks: np.ndarray, ggml_type: int, weight: torch.Tensor, what: str) -> None:
    """Sample rows of the kept blocks, de-quantized, must equal the loaded weight's rows exactly (in its dtype)."""
    if tuple(weight.shape[:1]) != blocks.shape[:1]:
        raise ModelError(f"model.quantization: gguf: {what}: {blocks.shape[0]} rows in the file, "
                         f"{weight.shape[0]} in the model: load the model from this file")
    n = blocks.shape[0]
    rows = sorted({0, n // 3, 2 * n // 3, n - 1})[:CHECKED_ROWS]
    got = _dequantized(torch.from_numpy(np.ascontiguousarray(blocks[rows])), ggml_type).to(weight.dtype)
    if got.shape != weight[rows].shape or not torch.equal(got, weight.detach()[rows].cpu()):
        raise ModelError(f"model.quantization: gguf: {what}: the file's blocks do not give the model's weights "
                         f"(rows {rows}): load the model from this file")
