"""Weight quantization: a loaded model's weights stored in int8 or int4 through torchao, and the bytes they really hold.

    quantize_model(model, "int8" | "int8-dynamic" | "int4:g64" | "none")  the model, quantized in place
    weight_bytes(model)                    measured from the stored tensors (a torchao tensor: its inner codes, scales
                                           and zero points), a tensor shared by two modules once
    estimate_weight_bytes(model, name)     the same figure from the shapes of an unquantized model (selection's budget)

Library: torchao, chosen because its CPU and CUDA paths run under torch.compile (inductor lowers the int8 matmul to a
fused int8 kernel; int4 calls a packed int4 kernel), so the compiled engine gets the benefit; bitsandbytes' CPU
backend has no compiled path. What each name stores, per Linear [N out, K in]:
    int8          Int8WeightOnlyConfig: int8 codes per output row, an fp32 scale and an int8 zero point per row
    int8-dynamic  Int8DynamicActivationInt8WeightConfig: the same weights; activations quantized per token at run time
    int4:gG       CPU: PrototypeInt4WeightOnlyConfig (aten's tinygemm layout for _weight_int4pack_mm_for_cpu): 4-bit
                  asymmetric codes per group of G inputs, a scale and a zero per group in the model dtype; a Linear
                  whose N is not a multiple of 16 or K not of G is stored in int8 instead. CUDA: Int4WeightOnlyConfig
                  (tile-packed for tinygemm). bfloat16 models only: on CPU a float32 activation takes aten's slow
                  path (measured ~500× slower than bfloat16 for one row), on CUDA the kernel is bfloat16.
The input embedding is a lookup, not a matmul: `QuantEmbedding` gathers the ids' rows of codes and scales. Under int4 on
CPU it is stored like an int4 Linear (aten's packing, whose row order `int4_row_block` finds by packing a probe), else
(and under `int4:gG:e8`, for the quality an int8 embedding and head keep) in int8 per row. A tied embedding and
output head stay tied: one tensor serves both, so nothing is stored twice.
Does not know about manifests, quality or selection.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol, TypeGuard

import torch

from runner.errors import ModelError
from runner.infer.config.quantization import parse_quantization

log = logging.getLogger(__name__)
# Importing torchao (transformers does, while loading any model, once it is installed) logs "Failed to load
# ...cutlass.so" on a CPU-only torch, and torch's pytree two deprecation notices about torchao's enums: noise to a user.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

INT4_ROWS = 16  # aten's int4 CPU packing takes N (output rows) in multiples of 16
INT8_ROW_BYTES = 4 + 1  # per output row: an fp32 scale and an int8 zero point (torchao's Int8Tensor)


class QuantEmbedding(torch.nn.Module):
    """An input embedding read from a quantized tensor [V,D]: gather the ids' rows of codes, scales and zero points.
    The tensor is torchao's Int8Tensor (int8 codes per row) or Int4OpaqueTensor (aten's CPU int4 packing)."""

    def __init__(self, weight: torch.nn.Parameter, embed_scale: torch.Tensor | float | None = None):
        super().__init__()
        self.weight = weight
        self.embed_scale = embed_scale  # models that scale their embeddings (Gemma) keep doing so
        self.row_block = int4_row_block() if hasattr(weight, "scale_and_zero") else None  # a constant to a graph

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B,T] → [B,T,D]
        w: Any = self.weight  # torchao's tensor subclass: its qdata, scale, … are not in torch's types
        if self.row_block is not None:
            rows = int4_rows(w.qdata, w.scale_and_zero, ids, self.row_block).to(w.dtype)
        else:  # Int8Tensor: qdata int8 [V,D], scale [V,1], zero_point [V,1]
            codes = w.qdata[ids].float() - w.zero_point[ids].float()
            rows = (codes * w.scale[ids].float()).to(w.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale


def int4_codes(packed: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The 4-bit codes of rows `ids` from aten's CPU int4 packing: packed [N,K/2] uint8 holds, per block of `block`
    rows, K rows of block/2 bytes whose low nibbles are the block's first half of rows and high nibbles the second."""
    rows, half_k = packed.shape
    cols, half = 2 * half_k, block // 2
    blocks = packed.view(rows // block, cols, half)  # [N/block, K, block/2]
    in_block = (ids % block).unsqueeze(-1)  # [...,1]
    bytes_ = blocks[(ids // block).unsqueeze(-1), torch.arange(cols, device=ids.device), in_block % half]  # [...,K]
    return torch.where(in_block < half, bytes_ & 15, bytes_ >> 4)


def int4_rows(packed: torch.Tensor, scale_and_zero: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Rows `ids` dequantized in float32 as the int4 kernel does: (code − 8)·scale + zero per group of K/G columns;
    scale_and_zero [K/G,N,2]."""
    codes = int4_codes(packed, ids, block).float()  # [...,K]
    groups = scale_and_zero.shape[0]
    params = scale_and_zero[:, ids].float().movedim(0, -2)  # [...,K/G,2]
    grouped = codes.unflatten(-1, (groups, -1))  # [...,K/G,G]
    return ((grouped - 8) * params[..., :1] + params[..., 1:]).flatten(-2)


@functools.cache
def int4_row_block() -> int | None:
    """How many rows aten's CPU int4 packing interleaves (64 on this AVX-512 build; it follows the vector width):
    the block size under which a packed probe reads back exactly, or None when none does (the embedding then stays
    int8, a layout this module cannot read being no reason to fail)."""
    probe = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    if packed.dtype != torch.uint8 or packed.shape != (128, 32):
        return None
    for block in (64, 32, 16, 128):
        if torch.equal(int4_codes(packed, torch.arange(128), block).int(), probe):
            return block
    return None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really stores: a tensor subclass's inner tensors, summed; a plain tensor's elements."""
    if is_quantized(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def weight_bytes(model) -> int:
    """Measured bytes of every parameter; `parameters()` yields a tensor shared by two modules once."""
    return sum(tensor_bytes(p) for p in model.parameters())


class Flattenable(Protocol):
    """A tensor subclass (torch's traceable wrapper protocol): the names of its inner tensors, and a context."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]: ...


def is_quantized(t: torch.Tensor) -> TypeGuard[Flattenable]:
    """A torchao tensor subclass (codes, scales, zero points inside), not a plain tensor."""
    return hasattr(t, "__tensor_flatten__")


# --- what goes where ------------------------------------------------------------------------------------------------

def assignments(model, quantization: str) -> list[tuple[str, torch.nn.Linear | torch.nn.Embedding, str]]:
    """(module name, module, how) for every module a quantization changes; how is int8, int8-dynamic, int4,
    embedding-int8 / embedding-int4 (rows of its own) or tied (the embedding reads the head's tensor). The one place
    both quantize_model and estimate_weight_bytes read, so the estimate follows what is done."""
    name, options = parse_quantization(quantization)
    if name == "none":
        return []
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    cuda = next(model.parameters()).device.type == "cuda"
    int4_lookup = (name == "int4" and options["embedding_bits"] == 4 and not cuda
                   and _int4_readable(embedding.weight.shape, options["group_size"]))
    plan: list[tuple[str, torch.nn.Linear | torch.nn.Embedding, str]] = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        how = name
        if module is head and tied and not int4_lookup:
            how = "int8-dynamic" if name == "int8-dynamic" else "int8"  # its rows are read by the lookup too
        elif name == "int4" and not cuda and (module.out_features % INT4_ROWS or
                                              module.in_features % options["group_size"]):
            how = "int8"
        plan.append((module_name, module, how))
    names = {id(m): n for n, m in model.named_modules()}
    plan.append((names[id(embedding)], embedding,
                 "tied" if tied else "embedding-int4" if int4_lookup else "embedding-int8"))
    return plan


def _int4_readable(shape: torch.Size, group_size: int) -> bool:
    """Whether `QuantEmbedding` can gather rows of a [V,D] table in aten's CPU int4 packing."""
    block = int4_row_block()
    return block is not None and shape[0] % block == 0 and shape[1] % group_size == 0


def estimate_weight_bytes(model, quantization: str) -> int:
    """Bytes `model` (unquantized) would hold once quantized, from its shapes; equals `weight_bytes` afterwards."""
    name, options = parse_quantization(quantization)
    total = weight_bytes(model)
    dtype_bytes = next(model.parameters()).element_size()
    for _, module, how in assignments(model, quantization):
        if how == "tied":
            continue  # its bytes are the head's
        rows, cols = module.weight.shape
        total -= tensor_bytes(module.weight)
        if how in ("int4", "embedding-int4"):
            total += rows * cols // 2 + cols // options["group_size"] * rows * 2 * dtype_bytes
        else:
            total += rows * cols + rows * INT8_ROW_BYTES
    return total


# --- quantizing -----------------------------------------------------------------------------------------------------

def quantize_model(model, quantization: str):
    """Quantize `model`'s Linear weights and input embedding in place (see the module docstring); returns it."""
    name, options = parse_quantization(quantization)
    if name == "none":
        return model
    ao = _torchao()
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"model.quantization: {quantization} runs on cpu or cuda, not {device.type}")
    if name == "int4" and model.dtype != torch.bfloat16:
        raise ModelError(f"quantization {quantization} runs in bfloat16 (torchao's int4 kernels; on CPU float32 "
                         f"takes a path hundreds of times slower): set model.dtype: bfloat16, or use int8")
    configs = _configs(ao, options.get("group_size"), device)
    plan = assignments(model, quantization)
    head = model.get_output_embeddings()
    for _, module, how in plan:
        if how in configs:
            ao.quantize_(module, configs[how])
    for _, module, how in plan:
        if how == "tied":
            model.set_input_embeddings(QuantEmbedding(head.weight, getattr(module, "embed_scale", None)))
        elif how.startswith("embedding"):
            table = module.weight.detach()
            weight = (ao.Int4Opaque.from_hp(table, [1, options["group_size"]]) if how == "embedding-int4"
                      else ao.Int8Tensor.from_hp(table, granularity=ao.PerRow()))
            model.set_input_embeddings(QuantEmbedding(torch.nn.Parameter(weight, requires_grad=False),
                                                      getattr(module, "embed_scale", None)))
    asked = name == "int4" and options["embedding_bits"] == 8  # :e8: the lookup's table in int8 is no fallback
    fallback = [module_name for module_name, module, how in plan if name == "int4" and how.endswith("int8")
                and not (asked and (module is head or how == "embedding-int8"))]
    if fallback:
        log.info("int4: stored in int8 (output rows not a multiple of %d, inputs not of the group size, or an "
                 "embedding whose rows the int4 packing cannot give back): %s", INT4_ROWS, ", ".join(fallback))
    return model


class _TorchAO:
    """The torchao names used here, imported once (importing torchao takes seconds and logs about CUDA libraries)."""

    def __init__(self):
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            PerRow,
            quantize_,
        )
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
        from torchao.utils import should_reduce_range

        self.quantize_, self.PerRow, self.Int8Tensor, self.Int4Opaque = quantize_, PerRow, Int8Tensor, Int4OpaqueTensor
        self.Int8WeightOnly, self.Int8Dynamic = Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig
        self.Int4CPU, self.Int4CUDA, self.should_reduce_range = (PrototypeInt4WeightOnlyConfig, Int4WeightOnlyConfig,
                                                                 should_reduce_range)


_AO: list[_TorchAO] = []


def _torchao() -> _TorchAO:
    if not _AO:
        try:
            _AO.append(_TorchAO())
        except ImportError as exc:
            raise ModelError(f"model.quantization needs torchao (pip install 'torchao>=0.18'): {exc}") from None
    return _AO[0]


def _configs(ao: _TorchAO, group_size: int | None, device: torch.device) -> dict:
    """how → torchao config; set_inductor_config off: quantizing must not change inductor's settings for others."""
    configs = {"int8": ao.Int8WeightOnly(set_inductor_config=False),
               "int8-dynamic": ao.Int8Dynamic(set_inductor_config=False,
                                              reduce_range=ao.should_reduce_range(device))}
    if group_size is not None:
        configs["int4"] = (ao.Int4CUDA(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                       set_inductor_config=False) if device.type == "cuda"
                           else ao.Int4CPU(group_size=group_size, set_inductor_config=False))
    return configs
