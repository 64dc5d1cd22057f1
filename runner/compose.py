"""Manifest file + overrides → validated Manifest. With sweep.py, the only importer of hydra and omegaconf.

Hydra composes (a `defaults:` list may pull fragments from folders beside the manifest, and
`key=value` overrides any field); pydantic validates. Hydra forgets where values came from, so we
read the file once more with PyYAML's safe composer to map every key path to its line and column,
and report each problem at its source: `file:line:col` or the override that set it.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from runner.errors import ManifestError, Problem, format_loc
from runner.manifest import Manifest
from runner.paths import missing_paths
from runner.yamlsafe import compose_checked

Loc = tuple  # a key path: ("targets", 0, "runs", 1, "generate", "top_p")


def load_manifest(path: str | Path, overrides: list[str] | tuple = ()) -> tuple[Manifest, dict]:
    """Compose, resolve and validate; returns the Manifest and the resolved plain dict."""
    path = Path(path)
    file = str(path)
    if not path.is_file():
        raise ManifestError([Problem("", "file not found" if not path.exists() else "not a file", file)], file)
    if path.suffix != ".yaml":
        raise ManifestError([Problem("", "a manifest is a .yaml file (Hydra composes only .yaml)", file)], file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        before = path.read_bytes()[:exc.start]
        line, column = before.count(b"\n") + 1, exc.start - before.rfind(b"\n")
        raise ManifestError([Problem("", f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x})",
                                     f"{file}:{line}:{column}")], file) from None
    locations = yaml_locations(text, file)
    raw = _compose(path, list(overrides), locations)
    raw.setdefault("name", path.stem)
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(problems_from(exc, file, locations, overrides), file) from None
    missing = missing_paths(manifest, path.parent)
    if missing:
        override_locs = {_override_loc(o): o for o in overrides}
        raise ManifestError([Problem(format_loc(loc), message, _source(loc, file, locations, override_locs))
                             for loc, message in missing], file)
    return manifest, raw


def yaml_locations(text: str, file: str) -> dict[Loc, tuple[int, int]]:
    """Map each key path to its 1-based (line, column); YAML syntax errors become a ManifestError."""
    root = compose_checked(text, file)
    if root is None:
        raise ManifestError([Problem("", "the file is empty; a manifest needs at least 'targets'", file)], file)
    if not isinstance(root, yaml.MappingNode):
        raise ManifestError([Problem("", "a manifest is a mapping of keys (version, name, targets, ...)",
                                     f"{file}:{root.start_mark.line + 1}:{root.start_mark.column + 1}")], file)
    out: dict[Loc, tuple[int, int]] = {}

    def walk(node, loc: Loc) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                out[loc + (key.value,)] = (key.start_mark.line + 1, key.start_mark.column + 1)
                walk(value, loc + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out[loc + (i,)] = (item.start_mark.line + 1, item.start_mark.column + 1)
                walk(item, loc + (i,))

    walk(root, ())
    return out


def _compose(path: Path, overrides: list[str], locations: dict) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    file = str(path)
    # `key=value` sets or adds the key; typos are then caught by the schema, with a suggestion.
    hydra_overrides = [hydra_override(o) for o in overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            cfg = compose(config_name=path.stem, overrides=hydra_overrides)
        raw = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:  # YAML: a defaults fragment
        raise ManifestError([Problem(_omegaconf_key(exc), _first_line(exc), _hydra_source(exc, file, overrides))],
                            file) from None
    finally:
        GlobalHydra.instance().clear()
    raw.pop("hydra", None)
    return raw


def hydra_override(override: str) -> str:
    """`key=value` sets the key or adds it (`++`); `+key`/`~key` keep Hydra's meaning."""
    return override if override[:1] in "+~" else "++" + override


def _omegaconf_key(exc: Exception) -> str:
    return str(getattr(exc, "full_key", "") or "")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _hydra_source(exc: Exception, file: str, overrides) -> str:
    text = str(exc)
    named = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in text]
    return f"override '{named[0].removeprefix('++')}'" if named else file


def problems_from(exc: ValidationError, file: str, locations: dict, overrides=()) -> list[Problem]:
    """One Problem per pydantic error, located in the file or in the override that set it."""
    override_locs = {_override_loc(o): o for o in overrides}
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        message, hint = _describe(err, loc)
        problems.append(Problem(format_loc(loc), message, _source(loc, file, locations, override_locs), hint))
    return problems


def _describe(err: dict, loc: Loc) -> tuple[str, str]:
    kind, message = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        valid = fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
        return "unknown key", hint
    if kind == "missing":
        return "required key is missing", ""
    hint = ""
    if kind == "literal_error" and isinstance(err.get("input"), str):
        valid = [v.strip(" '") for v in err["ctx"]["expected"].replace(" or ", ",").split(",") if v.strip(" '")]
        close = difflib.get_close_matches(err["input"], valid, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else ""
    shown = "input" in err and kind not in {"model_type", "dict_type"} and not isinstance(err["input"], (dict, list))
    if shown and not (kind == "value_error" and str(err["input"]) in message):  # our own messages name it already
        message += f" (got {err['input']!r})"
    return message, hint


def _source(loc: Loc, file: str, locations: dict, override_locs: dict) -> str:
    for ov_loc, override in override_locs.items():
        if loc[: len(ov_loc)] == ov_loc:
            return f"override '{override.removeprefix('++')}'"  # as typed: '++' is how sweeps pass values
    for end in range(len(loc), -1, -1):  # the key itself, or the closest enclosing one in the file
        if loc[:end] in locations:
            line, col = locations[loc[:end]]
            return f"{file}:{line}:{col}"
    return file


def _override_loc(override: str) -> Loc:
    key = override.split("=", 1)[0].lstrip("+~")
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))



def fields_at(loc: Loc) -> list[str]:
    """The valid keys of the schema object at `loc` (list indices and dict keys skipped)."""
    cls: type[BaseModel] | None = Manifest
    parts = list(loc)
    while parts and cls is not None:
        part = parts.pop(0)
        if isinstance(part, int) or part not in cls.model_fields:
            return []
        cls, skip = _model_in(cls.model_fields[part].annotation)
        if skip and parts:
            parts.pop(0)  # a dict key or list index
    return list(cls.model_fields) if cls is not None else []


def _model_in(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model inside list[X] / dict[str, X] / X | None, and whether a key/index sits before it."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    container = origin in (list, dict)
    for arg in args:
        found, inner = _model_in(arg)
        if found is not None:
            return found, container or inner  # dict[str, X] | None: the key sits inside the optional
    return None, False
