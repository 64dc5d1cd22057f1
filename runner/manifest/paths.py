"""Input files: the one resolver that `run check`, the step hash and the steps all use.

Which manifest values are input files is marked in the schema (`json_schema_extra={"input_file": KIND}`):
  prompts  a prompts_file (.txt or .jsonl): read whole by its step, so it must be UTF-8 and bounded in size;
  text     an evaluation text (cache_quality_data, bench data) unless it is a builtin name or `hf:...`;
  model    a model id that is plainly a path: starts with `.`, `/` or `~`, or ends in `.gguf` or `.json` (a
           bare `owner/name` is a hub id).
A path is resolved once, here: `~` expanded, relative to the manifest's folder, symlinks followed (a loop
is an error, not a traceback). Text inputs are hashed streaming (never held whole), checked as UTF-8 in
the same pass, and refused beyond MAX_INPUT_MB; a model folder is fingerprinted by its files' names,
sizes and modification times (weights are hashed at load time, not at check). Results are memoised by
(path, size, mtime), so a sweep of a thousand points reads each file once.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from runner.errors import InputFileError, ModelError
from runner.infer.config.architecture import compiled_refusal
from runner.infer.config.llamacpp import missing as llamacpp_missing
from runner.infer.loading.model_files import check_gguf, read_config_file  # torch-free, as is all `run check` reads
from runner.infer.loading.texts import BUILTIN_TEXTS
from runner.infer.serve.prompts import prompt_lines, short_prompt

MAX_INPUT_MB = int(os.environ.get("RUNNER_MAX_INPUT_MB", "256"))  # a prompts file or eval text, in MiB
CHUNK = 1 << 20
MAX_FOLDER_FILES = 10_000
_MEMO: dict[tuple, InputFile] = {}


@dataclass(frozen=True)
class InputFile:
    path: Path  # resolved
    kind: str  # prompts | text | model
    digest: str  # sha256 of the content (text kinds) or of the folder listing (model)
    config: dict | None = None  # a .json model's config, checked (model_files.read_config_file)


def is_input(kind: str, value: object) -> bool:
    """Whether a marked field's value names a local file (builtin texts, hf: and hub ids do not)."""
    if not isinstance(value, str) or not value:
        return False
    if kind == "model":
        return value[0] in "./~" or value.endswith((".gguf", ".json"))
    if kind == "text":
        return value not in BUILTIN_TEXTS and not value.startswith("hf:")
    return True


def resolve(name: str, base_dir: Path) -> Path:
    """`~` expanded, relative to `base_dir` (the manifest's folder), symlinks followed."""
    path = Path(name).expanduser()
    path = path if path.is_absolute() else Path(base_dir).absolute() / path
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # a symlink loop (RuntimeError before Python 3.13)
        raise InputFileError(f"{name!r} is a symlink loop (looked for {path})") from None


def input_file(name: str, base_dir: Path, kind: str) -> InputFile:
    """The input file `name` resolved, checked and fingerprinted; InputFileError says what is wrong."""
    path = resolve(name, base_dir)
    what = {"prompts": "prompts file", "text": "text file", "model": "model path"}[kind]
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InputFileError(f"{what} {name!r} does not exist (looked for {path})") from None
    except OSError as exc:
        raise InputFileError(f"{what} {name!r} cannot be read: {exc.strerror} (looked for {path})") from None
    if kind == "model" and stat.S_ISDIR(info.st_mode) and path.suffix not in (".gguf", ".json"):
        return InputFile(path, kind, _folder_digest(path, name))  # a folder's own time misses edits inside
    key = (str(path), kind, info.st_size, info.st_mtime_ns)
    if key not in _MEMO:
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{what} {name!r} is not a regular file (looked for {path})")
        elif kind == "model":
            _readable(path, name, what)
            _MEMO[key] = InputFile(path, kind, _stat_digest([(path.name, info)]), _model_content(path, name))
        else:
            _MEMO[key] = InputFile(path, kind, _text_digest(path, name, what, info.st_size, kind))
    return _MEMO[key]


def read_text(name: str, base_dir: Path, kind: str = "prompts") -> tuple[Path, str]:
    """(resolved path, text) of a text input, after the same checks as `run check`."""
    found = input_file(name, base_dir, kind)
    try:
        return found.path, found.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # changed since it was checked
        raise InputFileError(f"{name!r} cannot be read as UTF-8 text: {exc}") from None


def text_source(source: str, base_dir: Path) -> str:
    """An evaluation text source as the library takes it: a builtin name or hf: unchanged, a file resolved."""
    return str(input_file(source, base_dir, "text").path) if is_input("text", source) else source


def model_source(block: dict, base_dir: Path) -> dict:
    """A model block (plain dict) with a local path id resolved, as the loader takes it."""
    model_id = block.get("id")
    if isinstance(model_id, str) and is_input("model", model_id):
        return {**block, "id": str(input_file(model_id, base_dir, "model").path)}
    return block


def _model_content(path: Path, name: str) -> dict | None:
    """A model file checked by its content, as the loader reads it: a .json config's values (None for the rest)."""
    try:
        if path.suffix == ".json":
            return read_config_file(path, name)
        if path.suffix == ".gguf":
            check_gguf(path, name)
    except ModelError as exc:
        raise InputFileError(str(exc)) from None
    return None


def _readable(path: Path, name: str, what: str) -> None:
    try:
        path.open("rb").close()
    except OSError as exc:
        raise InputFileError(f"{what} {name!r} cannot be read: {exc.strerror or exc} (looked for {path})") from None


def _text_digest(path: Path, name: str, what: str, size: int, kind: str) -> str:
    """sha256 of the file, read once in chunks: checked as UTF-8 (and a prompts file's lines) on the way."""
    if size > MAX_INPUT_MB * 2**20:
        raise InputFileError(f"{what} {name!r} is {size / 2**20:,.0f} MiB; input text files are limited to "
                             f"{MAX_INPUT_MB} MiB (set RUNNER_MAX_INPUT_MB to raise the limit)")
    digest, decoder, offset, line = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")(), 0, 1
    lines = _PromptLines(name, path.suffix) if kind == "prompts" else None
    try:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                try:
                    text = decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    bad = offset + max(exc.start, 0)
                    line += chunk[:max(exc.start, 0)].count(b"\n")
                    raise InputFileError(f"{what} {name!r} is not UTF-8 text (byte 0x{chunk[exc.start]:02x} at "
                                         f"offset {bad}, line {line})") from None
                if lines is not None:
                    lines.feed(text)
                line += chunk.count(b"\n")
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise InputFileError(f"{what} {name!r} is not UTF-8 text (it ends inside a character)") from None
    except OSError as exc:
        raise InputFileError(f"{what} {name!r} cannot be read: {exc.strerror or exc} (looked for {path})") from None
    if lines is not None:
        lines.close()
    elif not size:
        raise InputFileError(f"{what} {name!r} is empty")
    return digest.hexdigest()


class _PromptLines:
    """A prompts file's lines as they stream by: a .jsonl line is an object with a "prompt"; one prompt at least."""

    def __init__(self, name: str, suffix: str):
        self.name, self.jsonl, self.rest, self.number, self.prompts = name, suffix == ".jsonl", "", 0, 0

    def feed(self, text: str) -> None:
        *complete, self.rest = (self.rest + text).split("\n")
        for line in complete:
            self._line(line)

    def close(self) -> None:
        self._line(self.rest)
        if not self.prompts:
            raise InputFileError(f"prompts file {self.name!r} holds no prompts (every line is blank)")

    def _line(self, line: str) -> None:
        self.number += 1
        if not line.strip():
            return
        if self.jsonl:
            try:
                value = json.loads(line)
                value["prompt"]  # the key must be there
            except (ValueError, KeyError, TypeError, IndexError):
                raise InputFileError(f"prompts file {self.name!r}, line {self.number}: expected a JSON object with "
                                     'a "prompt" key, e.g. {"prompt": "Hello"}') from None
        self.prompts += 1


def _folder_digest(path: Path, name: str) -> str:
    """The files directly in a model folder (where transformers looks), at most MAX_FOLDER_FILES of them."""
    try:
        entries: list[tuple[str, os.stat_result]] = []
        for child in path.iterdir():
            if len(entries) >= MAX_FOLDER_FILES:
                raise InputFileError(f"model folder {name!r} holds more than {MAX_FOLDER_FILES:,} files: is it a "
                                     f"model folder? (looked for {path})")
            if child.is_file():
                entries.append((child.name, child.stat()))
    except OSError as exc:
        raise InputFileError(f"model folder {name!r} cannot be listed: {exc.strerror or exc} (looked for {path})"
                             ) from None
    if "config.json" not in {n for n, _ in entries}:
        raise InputFileError(f"model folder {name!r} has no config.json: not a transformers model folder "
                             f"(looked for {path})")
    return _stat_digest(sorted(entries))


def _stat_digest(entries: list) -> str:
    """A fingerprint of files by name, size and modification time: cheap for gigabytes of weights."""
    digest = hashlib.sha256()
    for name, info in entries:
        digest.update(f"{name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def marked_inputs(obj, loc: tuple = ()) -> list[tuple[tuple, str, str]]:
    """(key path, kind, value) of every input-file field set in a validated schema object, found by its mark."""
    out = []
    if isinstance(obj, BaseModel):
        for name, field in type(obj).model_fields.items():
            value = getattr(obj, name)
            kind = (field.json_schema_extra or {}).get("input_file") if isinstance(field.json_schema_extra,
                                                                                   dict) else None
            if kind is not None and not isinstance(kind, str):
                raise TypeError(f"{type(obj).__name__}.{name}: input_file marks a kind by name, got {kind!r}")
            if kind and is_input(kind, value):
                out.append((loc + (name,), kind, value))
            elif not kind:
                out += marked_inputs(value, loc + (name,))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            out += marked_inputs(item, loc + (i,))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            out += marked_inputs(item, loc + (key,))
    return out


def input_problems(manifest, base_dir: Path) -> list[tuple[tuple, str]]:
    """(key path, message) for every input file that is missing, unreadable, not UTF-8 or too large.

    The `models:` templates are skipped: the ones in use are checked where targets use them."""
    problems = []
    for loc, kind, value in marked_inputs(manifest.targets, ("targets",)):
        try:
            input_file(value, base_dir, kind)
        except InputFileError as exc:
            problems.append((loc, str(exc)))
    return (problems + compiled_problems(manifest, base_dir) + llamacpp_problems(manifest)
            + serve_prompt_problems(manifest, base_dir, problems))


def llamacpp_problems(manifest) -> list[tuple[tuple, str]]:
    """(key path of the engine, message) for every run on engine llama.cpp where llama-cpp-python is not installed
    (runner.infer.config.llamacpp.missing: it names the command that installs it)."""
    reason = llamacpp_missing()
    if reason is None:
        return []
    problems = []
    for t, target in enumerate(manifest.targets):
        for r, run in enumerate(target.runs):
            at = ("targets", t, "runs", r)
            if run.generate is not None and run.generate.engine == "llama.cpp":
                problems.append((at + ("generate", "engine"), reason))
            if run.bench is not None and "llama.cpp" in run.bench.engines:
                problems.append((at + ("bench", "engine" if run.bench.engine is not None else "engines"), reason))
    return problems


def serve_prompt_problems(manifest, base_dir: Path, known: list) -> list[tuple[tuple, str]]:
    """(key path of the prompts file, message) for every serve run whose prompts file is too short for the prompt
    lengths it may draw (less the shared prefix), judged by bytes (runner.infer.serve.prompts.short_prompt); a file
    already reported as unreadable is skipped."""
    problems = []
    for t, target in enumerate(manifest.targets):
        for r, run in enumerate(target.runs):
            loc = ("targets", t, "runs", r, "serve", "prompts_file")
            serve = run.serve
            if serve is None or serve.prompts_file is None or serve.prompt_tokens is None or \
                    any(where == loc for where, _ in known):
                continue
            path, text = read_text(serve.prompts_file, base_dir)
            need = serve.prompt_tokens.lengths().high - serve.prefix_tokens
            why = short_prompt(prompt_lines(text, path.suffix == ".jsonl"), need)
            if why:
                problems.append((loc, f"prompts file {serve.prompts_file!r}, {why}"))
    return problems


def compiled_problems(manifest, base_dir: Path) -> list[tuple[tuple, str]]:
    """(key path of the engine, message) for every run on the compiled engine whose model (the target's, or a
    speculative draft) is given as a config that attends through a sliding window (architecture.compiled_refusal,
    the engine's own decision). A model given otherwise is judged when it is loaded, before anything compiles."""
    problems = []
    for t, target in enumerate(manifest.targets):
        for r, run in enumerate(target.runs):
            at, draft = ("targets", t, "runs", r), None
            if run.generate is not None and run.generate.engine == "compiled":
                loc = at + ("generate", "engine")
            elif run.speculative is not None and run.speculative.engine == "compiled":
                loc, draft = at + ("speculative", "engine"), run.speculative.draft
            elif run.bench is not None and "compiled" in run.bench.engines:
                loc = at + ("bench", "engine" if run.bench.engine is not None else "engines")
                draft = run.bench.speculative.draft if run.bench.speculative is not None else None
            else:
                continue
            models = [(target.model, "the model")] + ([] if draft is None or isinstance(draft, str) else
                                                      [(draft, "the draft")])
            reasons = [reason for model, whose in models
                       if (reason := compiled_refusal(_config_of(model, base_dir), whose))]
            problems += [(loc, reasons[0])] if reasons else []
    return problems


def _config_of(model, base_dir: Path) -> dict:
    """A model block's config: given inline, or read from its .json file ({} when it is neither, or unreadable)."""
    if model.config is not None:
        return model.config
    if isinstance(model.id, str) and model.id.endswith(".json"):
        try:
            return input_file(model.id, base_dir, "model").config or {}
        except InputFileError:
            return {}  # reported as an input problem
    return {}


def input_digests(obj, base_dir: Path) -> dict[str, str | None]:
    """Key path → sha256 of every input file `obj` (a target's model, a run's block) reads; the step hash
    covers them. An input that cannot be read hashes as None (`run check` reports it; the step fails)."""
    out: dict[str, str | None] = {}
    for loc, kind, value in marked_inputs(obj):
        try:
            out[".".join(map(str, loc))] = input_file(value, base_dir, kind).digest
        except InputFileError:
            out[".".join(map(str, loc))] = None
    return out
