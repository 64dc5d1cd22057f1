"""Schema problems as the user reads them: each pydantic error → a Problem at its source, with the expected
type and range and the closest valid key. Knows the schema (runner.manifest.schema) and where values came from
(runner.manifest.sources); imports neither hydra nor omegaconf.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from runner.errors import Problem, ValueAt, format_loc
from runner.manifest.schema import Manifest
from runner.manifest.sources import Sources

Loc = tuple  # a key path: ("targets", 0, "runs", 1, "generate", "top_p")


def shown(override: str) -> str:
    """An override as the user typed it: without the `++` that sweeps and we add."""
    return override.removeprefix("++")


def problems_from(exc: ValidationError, sources: Sources, overrides=()) -> list[Problem]:
    """One Problem per pydantic error, located in the file or in the override that set it."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        error = (err.get("ctx") or {}).get("error")
        if isinstance(error, ValueAt):  # about a key below the validated object: reported at that key
            loc += error.key
            err = {**err, "msg": error.shown, "input": {}}
        where = source_of(loc, sources, overrides)
        message, hint = _describe(err, loc, None if where.startswith("override") else sources.booleans.get(loc))
        if loc and loc[-1] == "[key]":  # a mapping's key (a strategy's name) is what is wrong
            loc, message = loc[:-1], f"the name {loc[-2]!r}: {message}"
        problems.append(Problem(format_loc(loc), message, where, hint))
    return problems


OUT_OF_RANGE = {"int_parsing_size", "finite_number", "int_from_float"}


def _describe(err: Mapping[str, Any], loc: Loc, written: str | None = None) -> tuple[str, str]:
    """The message and hint of one error; `written`: the text YAML 1.1 read as the boolean given, if known."""
    kind, message = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        valid = fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
        return "unknown key", hint
    if kind == "missing":
        return "required key is missing", ""
    if kind in OUT_OF_RANGE:
        message = f"expected {_expected(loc)}"
    hint = ""
    if kind == "literal_error" and isinstance(err.get("input"), (str, bool)):
        valid = [v.strip(" '") for v in err["ctx"]["expected"].replace(" or ", ",").split(",") if v.strip(" '")]
        hint = closest(err["input"], valid, written)
    shown_input = "input" in err and kind not in {"model_type", "dict_type"} and not isinstance(err["input"],
                                                                                                (dict, list))
    if shown_input and not (kind == "value_error" and str(err["input"]) in message):  # our messages name it
        value = err["input"]
        if isinstance(value, str) and len(value) > 60:
            message += f" (got {len(value)} characters: {value[:40]!r}...)"
        else:
            plain = str(value).lower() if isinstance(value, bool) else repr(value)
            retold = written and written.lower() != plain
            message += f" (got {written}, read as {plain})" if retold else f" (got {plain})"
    return message, hint


YAML_BOOLEANS = {True: ("yes", "on", "true", "y"), False: ("no", "off", "false", "n")}  # YAML 1.1's spellings


def closest(given: str | bool, valid: list[str], written: str | None = None) -> str:
    """The did-you-mean hint: compared without case (`HF` → 'hf'); a value YAML 1.1 read as a boolean is
    compared as the word written (`no` → 'none') or, unknown, the words it may have been, and the hint says to
    quote it."""
    lowered = {v.lower(): v for v in valid}
    if isinstance(given, bool):
        for word in [written.lower()] if written else YAML_BOOLEANS[given]:
            close = difflib.get_close_matches(word, lowered, n=1, cutoff=0.6)
            if close:
                spellings = written or "/".join(YAML_BOOLEANS[given][:3])
                return (f"did you mean '{lowered[close[0]]}'? YAML 1.1 reads {spellings} as {str(given).lower()}: "
                        f"quote the value as text")
        return ""
    close = difflib.get_close_matches(given.lower(), lowered, n=1, cutoff=0.6)
    return f"did you mean '{lowered[close[0]]}'?" if close else ""


def _expected(loc: Loc) -> str:
    """The type and range of the field at `loc`, e.g. "an integer from 1 to 1000000"."""
    field = field_at(loc)
    if field is None:
        return "a smaller number"
    low = next((getattr(m, a) for m in field.metadata for a in ("ge", "gt") if getattr(m, a, None) is not None), None)
    high = next((getattr(m, a) for m in field.metadata for a in ("le", "lt") if getattr(m, a, None) is not None), None)
    kind = "an integer" if int in _types(field.annotation) else "a number"
    if low is not None and high is not None:
        return f"{kind} from {low} to {high}"
    return f"{kind} of at least {low}" if low is not None else f"{kind} of at most {high}" if high is not None else kind


def _types(annotation) -> set:
    out, parts = set(), [annotation]
    while parts:
        part = parts.pop()
        out.add(part)
        parts += typing.get_args(part)
    return out


def source_of(loc: Loc, sources: Sources, overrides=()) -> str:
    for override in overrides:  # the override set the value, or added the key the value sits under
        ov = override_loc(override)
        if loc[: len(ov)] == ov or (loc and ov[: len(loc)] == loc and loc not in sources.locations):
            return f"override '{shown(override)}'"
    return sources.at(loc)


def override_loc(override: str) -> Loc:
    key = override.split("=", 1)[0].lstrip("+~")
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def field_at(loc: Loc):
    """The schema's FieldInfo at `loc` (None when `loc` is not a field)."""
    cls: type[BaseModel] | None = Manifest
    parts, field = list(loc), None
    while parts:
        if cls is None:
            return None
        part = parts.pop(0)
        if isinstance(part, int) or part not in cls.model_fields:
            return None
        field = cls.model_fields[part]
        cls, skip = _model_in(field.annotation)
        if skip and parts:
            parts.pop(0)  # a dict key or list index
    return field


def fields_at(loc: Loc) -> list[str]:
    """The valid keys of the schema object at `loc` (list indices and dict keys skipped)."""
    if not loc:
        return list(Manifest.model_fields)
    field = field_at(loc)
    cls = _model_in(field.annotation)[0] if field is not None else None
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
