"""A model file judged by its content, not its name, without torch: a `.json` transformers config must be a small
UTF-8 JSON object a causal LM can be built from (runner.infer.config.architecture.config_problem), and a `.gguf`
file must begin with GGUF's magic bytes. `run check` (runner.manifest.paths) and the loader (models.py) read them
through these functions, so both say the same thing about the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.errors import ModelError
from runner.infer.config.architecture import BYTE_VOCAB, config_problem

MAX_CONFIG_BYTES = 4 * 2**20  # a transformers config is a few KiB
GGUF_MAGIC = b"GGUF"


def read_config_file(path: Path, name: str, min_vocab: int = BYTE_VOCAB) -> dict:
    """The config in the `.json` file at `path` (`name` as the user gave it); ModelError says what is wrong.
    `min_vocab`: the least vocab_size allowed (config_problem's)."""
    what = f"model config {name!r}"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except IsADirectoryError:
        raise ModelError(f"{what} is a folder, not a file: a .json model is a transformers config file") from None
    except OSError as exc:
        raise ModelError(f"{what} cannot be read: {exc.strerror or exc} (looked for {path})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ModelError(f"{what} is larger than {MAX_CONFIG_BYTES:,} bytes: a transformers config is a few KiB")
    if not data.strip():
        raise ModelError(f"{what} is empty: expected a transformers config, a JSON object with model_type "
                         f"(e.g. llama) and the sizes to change")
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ModelError(f"{what} nests too deep (hundreds of levels of lists or objects): a config is "
                         f"shallow") from None
    except ValueError as exc:  # numbers past the integer-string limit, and the like
        raise ModelError(f"{what} is not valid JSON: {exc}") from None
    problem = config_problem(config, min_vocab)
    if problem:
        raise ModelError(f"{what}: {problem}")
    return config


def check_gguf(path: Path, name: str) -> None:
    """ModelError unless the file at `path` begins with GGUF's magic bytes."""
    try:
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except IsADirectoryError:
        raise ModelError(f"GGUF file {name!r} is a folder, not a file") from None
    except OSError as exc:
        raise ModelError(f"GGUF file {name!r} cannot be read: {exc.strerror or exc} (looked for {path})") from None
    if head != GGUF_MAGIC:
        got = "it is empty" if not head else f"it begins with {head!r}"
        raise ModelError(f"model file {name!r} is not a GGUF file: a GGUF file begins with the bytes 'GGUF', "
                         f"{got}")
