"""The compiled engine's one-token step in C++ (kernels/csrc/llama_step.cpp, the op runner::llama_step) for the
models and caches it covers: no Python between a step's layers.

Why: at batch 1 on a 2-core CPU, the inductor step's Python wrapper and dynamo's entry took 3–4 ms of a SmolLM2
step whose products take 21 ms in float32 and ~5 ms on 4-bit GGUF weights; llama.cpp spends none of that
(figures: docs/performance.md, "A decode step without Python"). Nothing is compiled for the shapes it serves.

Serves (`refusal` says why not, once per model; `serves`, per cache and rows):
    models   llama and qwen2 (RMSNorm, rotary embedding by rotate_half, SiLU-gated MLP, grouped-query attention,
             biases on q, k, v only), float32 or bfloat16, on CPU, every projection a float nn.Linear in the
             model's dtype or a GGUFLinear (float32 models), runner's kernels built
    caches   plain float layouts (fp32, fp16, bf16 K/V: StaticPlainLayer), read as stored (fp16 K/V under a
             bfloat16 model: the compiled graph rounds them to bfloat16 first, this step does not)
    steps    one new column, at most linear_rows' rows for the dtype (8 float32 or GGUF, 4 bfloat16; 16 bfloat16
             where its AMX path takes every product's shape: `cpu_linear.rows_served`)
    mixed    a step may also carry a joining prompt's tokens as extra rows of its products (`Extra`, `mixes`:
             float weights only; more rows than linear_rows takes go to aten's mm), each written into its row left
             of the step's column and attending causally there: serve/compiled_slots.py's mixed forward
Everything else (quantized and KIVI caches, longer feeds, more rows) keeps the compiled graph. The embedding and
the rotary embedding's cos/sin are the model's own modules, called from Python once a step.
Owns: the tensors and codes a model hands the op (made once), the step's call. Knows nothing of states or sampling.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch

from runner.infer.cache.static.cache import StaticKVCache
from runner.infer.cache.static.plain import StaticPlainLayer
from runner.infer.kernels import cpu_linear, gguf_rows
from runner.infer.quant.gguf_weights import GGUFLinear
from runner.infer.quant.weights import is_quantized

ARCHITECTURES = ("llama", "qwen2")
PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the op's code order
FLOAT_PRODUCT, INTERLEAVED = -1, 256  # a product's code: float (linear_rows), else ggml type | interleaved << 8


def refusal(model) -> str | None:
    """Why the native step cannot serve `model` (None when it can)."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"{config.model_type} is not one of {', '.join(ARCHITECTURES)}"
    if next(model.parameters()).device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return "the native step runs float32 or bfloat16 models on CPU"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "the native step's MLP is SiLU-gated without biases"
    if getattr(config, "use_sliding_window", False) or getattr(config, "attention_bias", False):
        return "the native step has no sliding window and biases on q, k, v only (qwen2's)"
    if not (cpu_linear.load() and gguf_rows.load()):
        return "runner's kernels are not built here"
    for layer in model.model.layers:
        for name in PRODUCTS:
            module = _projection(layer, name)
            if isinstance(module, GGUFLinear):
                if model.dtype != torch.float32:
                    return "GGUF weights run in float32 models"
            elif not _float_linear(module, model.dtype):
                return (f"{name} is a {type(module).__name__} of {type(module.weight).__name__}: float Linear or "
                        "GGUF only")
            elif name == "o_proj" and module.bias is not None:
                return "o_proj has a bias"
    head = model.lm_head
    if not (isinstance(head, GGUFLinear) or (_float_linear(head, model.dtype) and head.bias is None)):
        return f"the head is a {type(head).__name__}: float Linear without a bias or GGUF only"
    return None


class NativeStep:
    """A model's one-token step on runner::llama_step. Made once per model (refusal(model) must be None)."""

    def __init__(self, model):
        self.model = model
        config, layers = model.config, model.model.layers
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps, self.scaling = float(config.rms_norm_eps), float(layers[0].self_attn.scaling)
        self.max_rows = _max_rows(model)
        self.tensors: list[torch.Tensor | None] = []
        self.codes: list[int] = []
        for layer in layers:  # llama_step.cpp's LayerTensor order
            attention = layer.self_attn
            parts = [layer.input_layernorm.weight, *(_weight(_projection(layer, n)) for n in PRODUCTS[:4]),
                     layer.post_attention_layernorm.weight, *(_weight(_projection(layer, n)) for n in PRODUCTS[4:]),
                     attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]
            self.tensors += parts
            self.codes += [_code(_projection(layer, n)) for n in PRODUCTS]
        self.tensors += [model.model.norm.weight, _weight(model.lm_head)]
        self.codes.append(_code(model.lm_head))
        self.tensors = [t.detach() if t is not None else None for t in self.tensors]

    def serves(self, cache: StaticKVCache, new: int) -> bool:
        """Whether a step of `new` columns over `cache` runs here."""
        return (new == 1 and cache.batch <= self.max_rows
                and all(type(layer) is StaticPlainLayer for layer in cache.layers))

    def mixes(self, cache: StaticKVCache) -> bool:
        """Whether a step over `cache` may carry extra tokens (`__call__`'s `extra`): its products take any row
        count (float weights; GGUF's kernels take a few rows)."""
        return self.serves(cache, 1) and all(code == FLOAT_PRODUCT for code in self.codes)

    @torch.inference_mode()
    def __call__(self, cache: StaticKVCache, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
                 mask2d: torch.Tensor, extra: Extra | None = None) -> torch.Tensor:
        """[B,1] ids at [B,1] positions into column columns[0] of `cache`, [B,S] real columns → [B,1,V] logits.
        `extra` (`mixes` only): P more tokens written in the same forward, each at its (row, column) left of
        columns[0]; a row's extra tokens must be masked in mask2d, and attend causally to its columns."""
        column = int(columns[0])
        tokens, at = ids[:, 0], positions[:, 0]  # [B]
        if extra is not None:
            tokens, at = torch.cat([tokens, extra.ids]), torch.cat([at, extra.positions])  # [N]
        hidden = self.model.model.embed_tokens(tokens[None])  # [1,N,E]
        cos, sin = self.model.model.rotary_emb(hidden, at[None])  # [1,N,D]
        mask = mask2d.bool()
        mask[:, column] = True  # every row sees its own new column (a dummy row only that)
        caches = [t for layer in cache.layers for t in cast(StaticPlainLayer, layer).tensors()]  # K, V a layer
        logits = torch.ops.runner.llama_step(
            hidden[0].contiguous(), self.tensors, self.codes, caches, mask, cos[0].float().contiguous(),
            sin[0].float().contiguous(), [len(cache.layers), self.heads, self.kv_heads, self.head_dim, column,
                                          self.max_rows],
            self.eps, self.scaling, None if extra is None else extra.places)
        return logits[:, None]  # [B,1,V]


class Extra(NamedTuple):
    """A mixed step's extra tokens (`NativeStep.__call__`): ids [P], positions [P], places [P,2] (row, column),
    a row's tokens consecutive, in ascending columns."""

    ids: torch.Tensor
    positions: torch.Tensor
    places: torch.Tensor


def _max_rows(model) -> int:
    """The most rows a step takes: what linear_rows serves for every product of the model (16 in bfloat16 where
    the AMX path takes every shape, else cpu_linear.MAX_ROWS: GGUF products run in float32 models, 8)."""
    shapes = [_projection(layer, name).weight.shape for layer in model.model.layers for name in PRODUCTS]
    return min(cpu_linear.rows_served(model.dtype, int(inner), int(outer))
               for outer, inner in [*shapes, model.lm_head.weight.shape])


def _float_linear(module, dtype: torch.dtype) -> bool:
    """A plain nn.Linear whose weight is a plain tensor of `dtype` (not torchao's quantized subclasses)."""
    return type(module) is torch.nn.Linear and not is_quantized(module.weight) and module.weight.dtype == dtype


def _projection(layer, name: str):
    return getattr(layer.self_attn if name in PRODUCTS[:4] else layer.mlp, name)


def _weight(module) -> torch.Tensor:
    """What the op reads for a product: a float weight seen transposed ([K,N], linear_rows' wt), GGUF blocks."""
    return module.weight if isinstance(module, GGUFLinear) else module.weight.t()


def _code(module) -> int:
    return (module.ggml_type + INTERLEAVED * module.interleaved if isinstance(module, GGUFLinear)
            else FLOAT_PRODUCT)
