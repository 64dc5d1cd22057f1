"""`engine: llama.cpp`'s settings, torch-free: which of our cache kinds llama.cpp stores (its ggml K/V types), what
it refuses and why, whether the extra is installed, and the command that installs it.

Here, not in infer/llamacpp/, because the manifest's validators and `run check` decide with them before anything
is imported: a kind llama.cpp lacks, or a setting it cannot honour, is a located error instead of a surprise.
"""

from __future__ import annotations

import importlib.util
import os

from pydantic import BaseModel, ConfigDict, Field

from runner.infer.config.kinds import parse_kind

ENGINE_NAME = "llama.cpp"
INSTALL_COMMAND = "make setup-llamacpp"
# `run check` honours this variable to judge a machine without the extra (the catalogue of bad inputs holds a case
# that must pass whether or not llama-cpp-python is installed here).
ABSENT_ENV = "RUNNER_LLAMACPP_ABSENT"

# Our kind → llama.cpp's ggml type id for type_k / type_v (ggml.h's enum ggml_type).
GGML_TYPES = {"fp32": 0, "fp16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "bf16": 30}
GGML_NAMES = {"fp32": "f32", "fp16": "f16", "q4_0": "q4_0", "q4_1": "q4_1", "q8_0": "q8_0", "bf16": "bf16"}
# Bytes per element of each type (a block of 32 elements: q8_0 34 bytes, q4_0 18, q4_1 20).
GGML_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32}
QUANTIZED = {"q8_0", "q4_0", "q4_1"}


def kind_refusal(kind: str | None) -> str | None:
    """Why llama.cpp cannot store `kind` (None when it can: a float or ggml block type, no eviction)."""
    if kind is None or kind == "auto":
        return None
    options = parse_kind(kind)
    if options.eviction is not None:
        return (f"cache kind {kind!r}: llama.cpp keeps every token (no eviction after '+'): use "
                f"{options.name} alone or engine: eager")
    if options.family == "kivi":
        return (f"cache kind {kind!r}: llama.cpp has no KIVI (per-channel keys, a float residual): use q8_0, q4_0 or "
                "q4_1, or engine: eager")
    if options.name not in GGML_TYPES:
        return (f"cache kind {kind!r}: llama.cpp has no {options.name} K/V type: use one of "
                f"{', '.join(GGML_TYPES)}, or engine: eager")
    return None


def ggml_type(kind: str) -> int:
    """llama.cpp's type_k / type_v for `kind` (already judged by kind_refusal)."""
    return GGML_TYPES[parse_kind(kind).name]


def kind_name(kind: str) -> str:
    return parse_kind(kind).name


def flash_attention(kind: str | None, asked: bool | None) -> bool:
    """Whether llama.cpp runs flash attention: as asked, else on exactly when V is quantized (llama.cpp stores a
    quantized V only with flash attention)."""
    if asked is not None:
        return asked
    return kind is not None and kind != "auto" and parse_kind(kind).name in QUANTIZED


def missing() -> str | None:
    """Why `engine: llama.cpp` cannot run here (the extra is not installed), with the command that installs it."""
    if os.environ.get(ABSENT_ENV) or importlib.util.find_spec("llama_cpp") is None:
        return (f"engine: {ENGINE_NAME} needs llama-cpp-python, which is not installed here: run `{INSTALL_COMMAND}` "
                "(builds its wheel once for this CPU, then installs it into .venv; docs/engines.md)")
    return None


class LlamaCppOptions(BaseModel):
    """The knobs of `engine: llama.cpp` (llama.cpp's own names in the descriptions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int | None = Field(None, ge=1, le=1024, description=(
        "Threads llama.cpp decodes with (n_threads and n_threads_batch); unset = the machine's cores."))
    batch: int = Field(512, ge=1, le=1_000_000, description=(
        "Prompt tokens llama.cpp evaluates per forward (n_batch; also n_ubatch)."))
    flash_attn: bool | None = Field(None, description=(
        "llama.cpp's flash attention; unset = on exactly when V is quantized (q8_0, q4_0, q4_1), which llama.cpp "
        "requires."))


def quantized_v_problem(kind: str | None, options: LlamaCppOptions | None) -> str | None:
    """A quantized V with flash attention turned off: llama.cpp refuses the context."""
    asked = options.flash_attn if options is not None else None
    if kind not in (None, "auto") and kind_name(kind) in QUANTIZED and asked is False:
        return (f"cache kind {kind!r} quantizes V, which llama.cpp stores only with flash attention: remove "
                "llamacpp.flash_attn: false")
    return None
