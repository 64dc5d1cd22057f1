"""The GGUF file llama.cpp runs for a model: the zoo's own (at its own quantization), a local .gguf, or the torch
weights written as a GGUF with the `gguf` package (llama and qwen2 architectures), cached by their content.

Writing our own weights is what makes llama.cpp comparable with our engines token for token: the same f32 weights
on both sides (the zoo's GGUFs are Q4_1 / Q4_K_M, whose matmuls llama.cpp runs on q8 activations).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path

import torch

from runner.errors import ModelError
from runner.files import cache_folder
from runner.infer.loading.models import source_gguf
from runner.infer.quant.gguf_tensors import gguf_tensors

log = logging.getLogger(__name__)

# matrix types write_gguf writes (the gguf package quantizes them), each with its general.file_type (llama_ftype)
FILE_TYPES = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8}
QUANTIZABLE = tuple(FILE_TYPES)


def model_gguf(source: str | None, model, tokenizer, base_dir: Path | None = None) -> Path:
    """The GGUF llama.cpp loads for a model block's `source` (zoo:NAME, a .gguf path) or, otherwise, for the
    loaded torch `model` (written once as f32)."""
    path = source_gguf(source, base_dir)
    if path is None:
        return written_gguf(model, tokenizer)
    if not path.is_file():
        raise ModelError(f"engine: llama.cpp: no GGUF file at {path}")
    return path


def written_gguf(model, tokenizer, weight_type: str = "F32", vocab_from: Path | None = None) -> Path:
    """The torch model as a GGUF in the cache (gguf-f32/<content hash>.gguf), written on first use: f32, or its
    matrices in `weight_type` (write_gguf); `vocab_from`: the GGUF whose tokenizer settings it copies (VOCAB_KEYS)."""
    problem = unsupported(model.config)
    if problem:
        raise ModelError(f"engine: llama.cpp: {problem}")
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    if weight_type != "F32":  # f32 files keep the names they had
        digest.update(weight_type.encode())
    vocab = _vocab_settings(vocab_from) if vocab_from is not None else {}
    if vocab:  # files written without one keep the names they had
        digest.update(str(vocab).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    target = cache_folder("gguf-f32") / f"{digest.hexdigest()[:16]}.gguf"
    if not target.is_file():
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".partial", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            write_gguf(model, tokenizer, partial, weight_type, vocab)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def gguf_weight_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensors as stored (its own quantization): what llama.cpp holds as weights."""
    return sum(tensor.n_bytes for tensor in gguf_tensors(path).values())


ARCHITECTURES = ("llama", "qwen2")


def unsupported(config) -> str | None:
    """Why this writer cannot write the model (None when it can)."""
    if config.model_type not in ARCHITECTURES:
        return (f"writing a {config.model_type} model as GGUF is not supported ({' and '.join(ARCHITECTURES)} "
                "only): give the model as zoo:NAME or a .gguf file")
    if config.model_type == "llama" and (getattr(config, "attention_bias", False) or
                                         getattr(config, "mlp_bias", False)):
        return "writing a llama model with biases as GGUF is not supported"
    if getattr(config, "use_sliding_window", False):
        return "writing a model with a sliding window as GGUF is not supported"
    return None


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotary halves → llama.cpp's interleaved pairs (convert_hf_to_gguf.py's permute for q and k)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, tokenizer, path: Path, weight_type: str = "F32", vocab: dict | None = None) -> None:
    """A llama or qwen2 model's weights and its tokenizer's vocabulary as a GGUF file llama.cpp loads: all f32, or
    the matrices (embedding, head, projections) in `weight_type`, one of QUANTIZABLE (the gguf package quantizes them
    as llama.cpp's reference code does; the norms and qwen2's q, k, v biases stay f32). `vocab`: tokenizer settings
    of a GGUF of the same vocabulary to copy (`_vocab_settings`: how llama.cpp splits text, what its own tools
    tokenize by)."""
    import gguf

    if weight_type not in QUANTIZABLE:
        raise ModelError(f"cannot write GGUF weights as {weight_type}: one of {', '.join(QUANTIZABLE)}")
    quant_type = gguf.GGMLQuantizationType[weight_type]
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    arch = cfg.model_type  # qwen2's rotary embedding is llama.cpp's NEOX kind: its q and k rows are not permuted
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("runner-written")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(FILE_TYPES[weight_type])
    _add_vocab(writer, tokenizer, cfg, vocab or {})
    weights = {k: v.detach().to(torch.float32).cpu() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    biases = {f"self_attn.{x}_proj": f"attn_{x}" for x in "qkv"} if arch == "qwen2" else {}
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight" for ours, theirs in per_layer.items()}
        names |= {f"model.layers.{i}.{ours}.bias": f"blk.{i}.{theirs}.bias" for ours, theirs in biases.items()}
    for ours, theirs in names.items():
        tensor = weights[ours]
        if arch == "llama" and theirs.endswith("attn_q.weight"):
            tensor = _permute(tensor, heads)
        elif arch == "llama" and theirs.endswith("attn_k.weight"):
            tensor = _permute(tensor, kv_heads)
        array = tensor.contiguous().numpy()
        if quant_type != gguf.GGMLQuantizationType.F32 and array.ndim == 2:
            writer.add_tensor(theirs, gguf.quants.quantize(array, quant_type), raw_dtype=quant_type)
        else:
            writer.add_tensor(theirs, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# What `vocab_from` gives a written file: llama.cpp's pre-tokenizer (how text is split before BPE; "default" splits
# digits and punctuation unlike SmolLM2's "smollm", so llama-perplexity read other tokens: perplexity 23.2 against
# 15.6 on the same text), the token types (which ids are control tokens) and whether a BOS or a space goes first.
VOCAB_KEYS = ("tokenizer.ggml.pre", "tokenizer.ggml.token_type", "tokenizer.ggml.add_bos_token",
              "tokenizer.ggml.add_space_prefix")


def _vocab_settings(path: Path) -> dict:
    """VOCAB_KEYS' values in the GGUF at `path` (those it has): a str, a list of ints, or a bool."""
    import gguf

    fields, settings = gguf.GGUFReader(path).fields, {}
    for key in VOCAB_KEYS:
        if key in fields:
            values = fields[key].contents()
            settings[key] = values if isinstance(values, str | list) else bool(values)
    return settings


def _add_vocab(writer, tokenizer, cfg, settings: dict) -> None:
    """The tokenizer's byte-level BPE vocabulary and merges (llama.cpp's gpt2 kind); ids past the tokenizer's are
    unused placeholders; `settings` (_vocab_settings) in place of the defaults below. runner's llama.cpp engine
    never has llama.cpp tokenize (it hands it token ids); llama.cpp's own tools do."""
    import gguf

    tokens, types = [], []
    for i in range(cfg.vocab_size):
        token = tokenizer.convert_ids_to_tokens(i) if i < len(tokenizer) else None
        tokens.append(token if token is not None else f"[PAD{i}]")
        special = token is None or i in tokenizer.all_special_ids
        types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL)
    seen: set[str] = set()
    for i, token in enumerate(tokens):  # llama.cpp maps text → id: each text once
        if token in seen:
            tokens[i], types[i] = f"[DUP{i}]", gguf.TokenType.UNUSED
        seen.add(tokens[i])
    backend = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend.get("model", {}).get("merges", [])]
    types = settings.get("tokenizer.ggml.token_type", types)
    if len(types) != len(tokens):
        raise ModelError(f"the vocabulary to copy has {len(types)} token types for {len(tokens)} tokens")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(settings.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "tokenizer.ggml.add_space_prefix" in settings:
        writer.add_add_space_prefix(settings["tokenizer.ggml.add_space_prefix"])
    writer.add_token_merges(merges or [f"{tokens[0]} {tokens[0]}"])  # llama.cpp requires the key
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else (cfg.eos_token_id or [None])[0]
    if eos is not None:
        writer.add_eos_token_id(eos)
    bos = getattr(cfg, "bos_token_id", None)
    if isinstance(bos, int):
        writer.add_bos_token_id(bos)
    writer.add_add_bos_token(settings.get("tokenizer.ggml.add_bos_token", False))
