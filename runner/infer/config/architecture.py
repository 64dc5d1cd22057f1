"""A transformers config judged from its values, without torch or transformers: what `run check` can tell of a model
given as a config (inline or a `.json` file) and what the loader checks again before it builds one.

`config_problem` says what is wrong with a config a model would be built from (no or an unknown `model_type`, with
the closest known one; sizes that are not positive integers; heads that do not divide the width; too small a
vocabulary). `sliding_window` is the one decision of whether a model attends through a sliding window, on a
config's values (a plain mapping) or a loaded transformers config (an object): the compiled engine, which attends to
every column, refuses such a model (runner.infer.compiled.engine.engine_for; `run check` where the config says so).

The model types are read from transformers' own tables (CONFIG_MAPPING_NAMES, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
as source text: importing transformers imports torch, seconds that `run check` does not spend.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path

BYTE_VOCAB = 258  # tokens of the byte tokenizer a config model is built with (256 bytes, pad, eos)
WIDTHS = ("hidden_size", "n_embd", "d_model")  # a model's width, as configs name it
HEADS = ("num_attention_heads", "n_head", "num_heads")  # its query heads
SIZES = (*WIDTHS, *HEADS, "num_hidden_layers", "n_layer", "intermediate_size", "num_key_value_heads", "head_dim",
         "vocab_size")
EXAMPLE = "a transformers config: a JSON object with model_type (e.g. llama, qwen2, gpt2) and the sizes to change"


@functools.cache
def _transformers_names(variable: str, *files: str) -> frozenset[str]:
    """The keys of transformers' `variable` (an OrderedDict of (name, class name) pairs, extended by .update calls)
    read from the source of `files` under transformers/models/auto; empty when they cannot be read."""
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return frozenset()
    names: set[str] = set()
    for name in files:
        try:
            tree = ast.parse((Path(spec.origin).parent / "models" / "auto" / name).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            value = _assigned(node, variable)
            for item in ast.walk(value) if value is not None else ():
                if isinstance(item, ast.Tuple) and len(item.elts) == 2:
                    names |= _strings(item.elts[:1])
                elif isinstance(item, ast.Dict):
                    names |= _strings(item.keys)
    return frozenset(names)


def _assigned(node: ast.stmt, variable: str) -> ast.AST | None:
    """The value given to `variable` by `variable = ...` or `variable.update(...)`."""
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
        return node.value
    call = node.value if isinstance(node, ast.Expr) else None
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "update"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == variable):
        return call
    return None


def _strings(nodes) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def model_types() -> frozenset[str]:
    """Every model_type transformers' AutoConfig knows (empty when its tables cannot be read)."""
    return _transformers_names("CONFIG_MAPPING_NAMES", "auto_mappings.py", "configuration_auto.py")


def causal_lm_types() -> frozenset[str]:
    """The model types AutoModelForCausalLM builds."""
    return _transformers_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "modeling_auto.py")


def config_problem(config: object, min_vocab: int = BYTE_VOCAB) -> str | None:
    """What is wrong with `config` as the values a causal LM is built from, in words; None when nothing is.
    `min_vocab`: the least vocab_size (the tokenizer's tokens; the library's callers may pass 1 and clamp ids)."""
    if not isinstance(config, Mapping):
        return f"expected {EXAMPLE}, not {_json_kind(config)}"
    model_type = config.get("model_type")
    if model_type is None:
        return f"no model_type: expected {EXAMPLE}"
    if not isinstance(model_type, str):
        return f"model_type must be a name such as llama (got {model_type!r})"
    known = model_types()
    if known and model_type not in known:
        close = difflib.get_close_matches(model_type, sorted(causal_lm_types() or known), n=1, cutoff=0.6)
        return f"unknown model_type {model_type!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                                       " (transformers has no such architecture)")
    causal = causal_lm_types()
    if causal and model_type not in causal:
        return (f"model_type {model_type!r} has no causal language model in transformers (AutoModelForCausalLM): "
                "use a decoder such as llama, qwen2 or gpt2")
    for key in SIZES:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} must be a positive integer (got {value!r})"
    return _shape_problem(config, min_vocab)


def _shape_problem(config: Mapping, min_vocab: int) -> str | None:
    width = next((k for k in WIDTHS if config.get(k) is not None), None)
    heads = next((k for k in HEADS if config.get(k) is not None), None)
    if width and heads and config.get("head_dim") is None and config[width] % config[heads]:
        return (f"{heads} ({config[heads]}) does not divide {width} ({config[width]}): each head takes "
                f"{width} / {heads} features (or set head_dim)")
    kv = config.get("num_key_value_heads")
    if heads and kv is not None and config[heads] % kv:
        return (f"num_key_value_heads ({kv}) does not divide {heads} ({config[heads]}): each key/value head "
                f"serves a whole group of query heads")
    vocab = config.get("vocab_size")
    if vocab is not None and vocab < min_vocab:
        return (f"vocab_size {vocab} is smaller than the {min_vocab} tokens of the byte tokenizer a config model "
                f"is built with: leave vocab_size out, or make it at least {min_vocab}")
    return None


def _json_kind(value: object) -> str:
    kinds = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def sliding_window(config: object) -> str | None:
    """How `config` (a mapping of a config's values, or a transformers config) makes some layer attend through a
    sliding window, in words; None when every layer attends to every earlier position.

    `layer_types` decides where it is given (Qwen2's and Gemma's configs compute it); otherwise a `sliding_window`
    that is set is used unless `use_sliding_window` is false (Mistral's has no such switch), and with
    `use_sliding_window`, only by the layers from `max_window_layers` on (Qwen2's rule)."""
    text = getattr(config, "get_text_config", None)
    config = text(decoder=True) if callable(text) else config
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    types = get("layer_types")
    if types:
        other = sorted({str(t) for t in types} - {"full_attention"})
        return f"layer_types has {', '.join(other)}" if other else None
    window = get("sliding_window")
    if window is None or get("use_sliding_window") is False:
        return None
    first, layers = get("max_window_layers"), get("num_hidden_layers")
    if get("use_sliding_window") and isinstance(first, int) and isinstance(layers, int) and layers <= first:
        return None  # every layer sits below max_window_layers: full attention
    return f"sliding_window is {window}"


def compiled_refusal(config: object, whose: str = "this model") -> str | None:
    """Why the compiled engine cannot serve a model of this config (a mapping or a transformers config); None when
    it can. The one decision: `run check` asks it of a config the manifest gives, the engine of the loaded model."""
    reason = sliding_window(config)
    if reason is None:
        return None
    return (f"engine: compiled attends to every cached position, and {whose} attends through a sliding window "
            f"({reason}): use engine: eager")
