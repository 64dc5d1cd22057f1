"""Manifest file + overrides → validated Manifest. With execute/sweep.py and launchers.py, the only
importers of hydra and omegaconf.

Hydra composes (a `defaults:` list may pull fragments from folders beside the manifest, and
`key=value` overrides any field); pydantic validates. Hydra forgets where values came from, so
runner.manifest.sources reads the manifest and every fragment first and maps each key path to its file, line
and column; each problem is reported at its source: `file:line:col` or the override as typed.
Overrides are checked in plain words before Hydra sees them (its parser speaks in grammar tokens); schema
problems are described by runner.manifest.problems. A sweep's points are validated without composing each in full.
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import warnings
from pathlib import Path

from pydantic import ValidationError

from runner.errors import ManifestError, Problem, format_loc
from runner.manifest.paths import input_problems
from runner.manifest.problems import fields_at, override_loc, problems_from, shown, source_of  # noqa: F401 (fields_at: API)
from runner.manifest.schema import Manifest
from runner.manifest.sources import ENV_MESSAGE, ENV_RESOLVER, Sources, read_sources

Loc = tuple  # a key path: ("targets", 0, "runs", 1, "generate", "top_p")
KEY_PATH = re.compile(r"^[\w-]+(\.[\w-]+)*$")


def load_manifest(path: str | Path, overrides: list[str] | tuple = ()) -> tuple[Manifest, dict]:
    """Compose, resolve and validate; returns the Manifest and the resolved plain dict."""
    path = Path(path)
    sources = read_sources(path)
    check_overrides(sources, overrides)
    raw = _compose(path, list(overrides), sources)
    return validate(raw, path, sources, overrides), raw


def load_points(path: Path, override_lists: list[tuple[str, ...]]) -> list[ManifestError | None]:
    """Each list of overrides (a sweep point) validated: Hydra composes the manifest once, and each point's
    plain `key=value` overrides are applied to a copy (a point with other overrides is composed in full)."""
    sources = read_sources(path)
    base = _compose(path, [], sources, resolve=False)
    refs = _references(base)  # None: interpolations other than plain ${a.b} references
    try:
        resolved = _resolve(copy.deepcopy(base), sources) if refs is not None else None
    except ManifestError:
        resolved = None  # each point reports it, resolved on its own
    outcome: list[ManifestError | None] = []
    for overrides in override_lists:
        try:
            check_overrides(sources, overrides)
            independent = resolved is not None and refs is not None and _independent(overrides, refs, base)
            raw = _apply(resolved if resolved is not None and independent else base, overrides)
            if raw is None:
                load_manifest(path, overrides)
            else:
                validate(raw if independent else _resolve(raw, sources, overrides), path, sources, overrides)
            outcome.append(None)
        except ManifestError as exc:
            outcome.append(exc)
    return outcome


def _references(base: dict) -> set[tuple[str, ...]] | None:
    """The key paths that `${a.b}` interpolations in `base` read; None when some interpolation is more than that."""
    text = str(base)
    found = re.findall(r"\$\{\s*([\w-]+(?:\.[\w-]+)*)\s*\}", text)
    return {tuple(ref.split(".")) for ref in found} if text.count("${") == len(found) else None


def _independent(overrides, refs: set, base: dict) -> bool:
    """Whether the overrides can be applied to the already resolved manifest: they set plain values, no
    interpolation reads what they set (or anything under or above it), and no path runs through an
    interpolated value."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        parts = tuple(key.split("."))
        if "${" in value or any(ref[: len(parts)] == parts or parts[: len(ref)] == ref for ref in refs):
            return False
        node: object = base
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else \
                node.get(part) if isinstance(node, dict) else None
            if isinstance(node, str) and "${" in node:
                return False
    return True


def validate(raw: dict, path: Path, sources: Sources, overrides=()) -> Manifest:
    """The schema, then the input files it names; every problem located in a file or an override."""
    raw.setdefault("name", path.stem)
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(problems_from(exc, sources, overrides), sources.file) from None
    missing = input_problems(manifest, path.parent)
    runs_dir = Path(manifest.tracking.runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        missing.append((("tracking", "runs_dir"),
                        f"runs_dir {str(runs_dir)!r} is a file, not a folder: run folders cannot be made in it"))
    if missing:
        raise ManifestError([Problem(format_loc(loc), message, source_of(loc, sources, overrides))
                             for loc, message in missing], sources.file)
    return manifest


def check_overrides(sources: Sources, overrides) -> None:
    """Every override's form, in plain words, before Hydra: `key=value`, a key path that fits the manifest."""
    problems = []
    for override in overrides:
        reason = override_problem(override, sources.data)
        if reason:
            key = override.lstrip("+~").partition("=")[0]
            path = format_loc(override_loc(override)) if KEY_PATH.match(key) else ""
            problems.append(Problem(path, reason, f"override '{shown(override)}'"))
    if problems:
        raise ManifestError(problems, sources.file)


def override_problem(override: str, data) -> str | None:
    from hydra.errors import HydraException

    body = override.lstrip("+")
    if body.startswith("~"):
        body = body[1:].partition("=")[0] + "=x"
    if "=" not in body:
        return "expected key=value (e.g. seed=1)"
    key, _, value = body.partition("=")
    if not key.strip():
        return "nothing before '=': expected key=value (e.g. seed=1)"
    if value.startswith("="):
        return "expected key=value with a single '=' (got '==')"
    if not KEY_PATH.match(key) and not re.match(r"^[\w/-]+(@[\w.-]+)?$", key):
        return (f"{key!r} is not a key path: names and list indices joined by single dots "
                "(e.g. targets.0.runs.0.generate.seed)")
    if len(key) > 500:
        return f"the key is {len(key):,} characters long: no key path is"
    if ENV_RESOLVER.search(value):
        return ENV_MESSAGE
    unclosed = _unclosed(value)
    if unclosed:
        return f"{unclosed}; quote it to pass it as text: {key}='...'"
    try:
        override_value(hydra_override(override))  # plain numbers and words need no parser
    except HydraException as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"cannot read the value {value!r} ({reason}); quote it to pass it as text: {key}='...'"
    return _path_problem(key, data)


CLOSING = {"[": "]", "{": "}", "(": ")"}


def _unclosed(value: str) -> str | None:
    """A bracket the value opens and never closes (or closes with another), in words; quoted text skipped."""
    stack: list[tuple[str, int]] = []
    quote = ""
    for i, char in enumerate(value):
        if quote:
            quote = "" if char == quote and value[i - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char in CLOSING:
            stack.append((char, i))
        elif char in CLOSING.values():
            if not stack or CLOSING[stack[-1][0]] != char:
                return f"the value {value!r} closes {char!r} at character {i + 1} that nothing opened"
            stack.pop()
    if stack:
        char, i = stack[-1]
        return (f"the value {value!r} opens {char!r} at character {i + 1} and never closes it: add "
                f"{CLOSING[char]!r}")
    return None


def _path_problem(key: str, data) -> str | None:
    """A list index past the end of the manifest's list, or a name where an index goes."""
    node, where = data, ""
    for part in key.split("."):
        if isinstance(node, list):
            if not part.isdigit():
                return f"{where} is a list: expected an index (0 to {len(node) - 1}) after it, got {part!r}"
            if int(part) >= len(node):
                indices = "none" if not node else "index 0" if len(node) == 1 else f"indices 0 to {len(node) - 1}"
                return f"index {part} is past the end of {where}: the manifest has {len(node)} ({indices})"
            node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node:
                return None  # a new key: the schema judges it
            node = node[part]
        else:
            return None
        where = f"{where}.{part}" if where else part
    return None


def hydra_override(override: str) -> str:
    """`key=value` sets the key or adds it (`++`); `+key`/`~key` keep Hydra's meaning."""
    return override if override[:1] in "+~" else "++" + override


def _compose(path: Path, overrides: list[str], sources: Sources, resolve: bool = True) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hydra's advice (e.g. on _self_) is no error; the library prints nothing
            cfg = compose(config_name=path.stem, overrides=[hydra_override(o) for o in overrides])
    except (HydraException, OmegaConfBaseException, ValueError, OSError, RecursionError) as exc:
        named = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in str(exc)]
        loc = _key_loc(_full_key(exc)) or _holding(sources.data, hydra_reason(exc))
        if not loc and not named and ("defaults",) in sources.locations:
            loc = ("defaults",)  # the defaults list as Hydra reads it (its form, its entries)
        where = f"override '{shown(named[0])}'" if named else sources.at(loc) if loc else sources.file
        raise ManifestError([Problem(format_loc(loc), hydra_reason(exc), where)], sources.file) from None
    finally:
        GlobalHydra.instance().clear()
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)  # a composed config is a mapping
    raw.pop("hydra", None)
    return _resolve(raw, sources, overrides) if resolve else raw


def _resolve(raw: dict, sources: Sources, overrides=()) -> dict:
    """Interpolations resolved; an error is located at the `${...}` that failed."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except OmegaConfBaseException as exc:
        loc = _key_loc(_full_key(exc))
        message = hydra_reason(exc) + _interpolation_hint(str(exc), raw)
        raise ManifestError([Problem(format_loc(loc), message, source_of(loc, sources, overrides))],
                            sources.file) from None
    assert isinstance(resolved, dict)  # created from a dict
    return resolved


def _apply(base: dict, overrides) -> dict | None:
    """`base` with each `++key=value` set; None when an override needs Hydra (groups, +key, ~key, lists)."""
    raw = copy.deepcopy(base)
    for override in overrides:
        body = override.removeprefix("++") if override.startswith("++") else override
        if body[:1] in "+~" or not KEY_PATH.match(body.partition("=")[0]):
            return None
        value, is_sweep = override_value(hydra_override(body))
        if isinstance(value, (dict, list)) or is_sweep:
            return None
        node, parts = raw, body.partition("=")[0].split(".")
        for part in parts[:-1]:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                return None
            if not isinstance(node, (dict, list)):
                return None
        last = parts[-1]
        if isinstance(node, list) and last.isdigit() and int(last) < len(node):
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            return None
    return raw


PLAIN_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")
PLAIN_WORD = re.compile(r"^[A-Za-z_][\w-]*$")


@functools.lru_cache(maxsize=4096)
def parse_override(override: str):
    """Hydra's parse of one override (memoised: a sweep repeats the same ones in many points)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override)


def override_value(override: str) -> tuple[object, bool]:
    """(value, is a sweep) as Hydra's grammar reads `++key=value`; plain numbers and words without the parser."""
    text = override.partition("=")[2]
    if PLAIN_NUMBER.match(text):
        return (float(text) if "." in text else int(text)), False
    if PLAIN_WORD.match(text) and text.lower() not in ("true", "false", "null", "nan", "inf"):
        return text, False
    parsed = parse_override(override)
    return parsed.value(), parsed.is_sweep_override()


def hydra_reason(exc: Exception) -> str:
    """Hydra's message and its causes (where the real reason often is), one line each, without internals."""
    lines: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(lines) < 4:
        text = str(current).strip().split("Config search path:")[0]
        text = re.sub(r"(Available options in '[^']*'):\s*\n(.*)", lambda m: m.group(1) + ": "
                      + ", ".join(m.group(2).split()), text, flags=re.DOTALL)
        for line in text.splitlines():
            line = line.strip()
            internal = line.startswith(("full_key:", "object_type=", "reference_type=")) or line == "None"
            if line and not internal and not any(line in earlier for earlier in lines):
                lines.append(line)
        current = current.__cause__ or current.__context__
    reason = "; ".join(lines) or type(exc).__name__
    missing = re.search(r"Could not find '(?:[^']*/)?([^'/]+)'.*Available options in '[^']*': ([\w, -]+)", reason)
    close = difflib.get_close_matches(missing.group(1), missing.group(2).split(", "), n=1) if missing else []
    return reason + (f" (did you mean '{close[0]}'?)" if close else "")


def _full_key(exc: BaseException | None) -> str:
    """OmegaConf's key path of the value that failed, from the error or its causes (Hydra wraps them)."""
    while exc is not None:
        full_key = getattr(exc, "full_key", None)
        if full_key:
            return str(full_key)
        exc = exc.__cause__ or exc.__context__
    return ""


def _holding(data, message: str, loc: Loc = ()) -> Loc:
    """The key path of the first string in `data` that holds the text a grammar error quotes ('${targets')."""
    quoted = re.search(r"input '([^']+)'", message)
    if quoted is None:
        return ()
    if isinstance(data, str):
        return loc if quoted.group(1) in data else ()
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _holding(value, message, loc + (key,))
        if found:
            return found
    return ()


def _interpolation_hint(message: str, raw: dict) -> str:
    found = re.search(r"Interpolation key '([^']+)' not found", message)
    if not found:
        return ""
    *parents, name = found.group(1).split(".")
    node: object = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    close = difflib.get_close_matches(name, [str(k) for k in node], n=1) if isinstance(node, dict) else []
    return f" (did you mean '{'.'.join([*parents, close[0]])}'?)" if close else ""


def _key_loc(full_key: str) -> Loc:
    """OmegaConf's `targets[0].model` → ("targets", 0, "model")."""
    return tuple(int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", full_key))
