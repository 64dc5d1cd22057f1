"""The manifest reference, docs/manifest.md, generated from the pydantic schema in runner/manifest/schema.py.

    python -m runner.manifest.docgen            print the reference
    python -m runner.manifest.docgen --write    rewrite docs/manifest.md
    python -m runner.manifest.docgen --check    exit 1 if docs/manifest.md differs from what the schema gives

Walks the Manifest model and every model reachable from its fields, one section per block, one row per
key: type, default, bounds, description. Imports the schema only (pydantic, no torch); knows nothing of
steps or the library beyond what the schema names.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from runner.manifest import schema
from runner.manifest.shapes import FILLED_IN

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "manifest.md"
COMMAND = "python -m runner.manifest.docgen --write"
# Keys the schema requires but composition fills in before validation when the file leaves them out.
FILLED_BY_COMPOSE = FILLED_IN  # keys the loader fills in (runner.manifest.shapes)


def render() -> str:
    """The whole reference as markdown."""
    sections, holders = _blocks(schema.Manifest), _holders(schema.Manifest)
    lines = [
        "# Manifest reference",
        "",
        f"<!-- Generated from runner/manifest/schema.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every key a manifest may hold, generated from the pydantic schema (`runner/manifest/schema.py`), which is",
        "the single source of truth: `run schema` prints the same schema as JSON Schema for editor completion.",
        "Every block forbids unknown keys (an unknown key is an error naming the file, the line and the",
        "closest valid key). A key left out takes its default; *unset* means the key is off or taken from",
        "elsewhere, as its description says. Sizes named `_mb` are MiB (2^20 bytes).",
        "",
        "Wherever a list of plain values goes, one value alone is a one-element list (`quantizations: none` is",
        "`[none]`, `cache_kinds: fp16` is `[fp16]`), and a model block may be given as its id alone",
        "(`model: zoo:smollm2-135m`); the JSON Schema says the same (`runner/manifest/shapes.py` holds both rules).",
        "",
        "Blocks:",
        "",
    ]
    lines += [f"- [{_title(paths)}](#{_anchor(model)})" for model, paths in sections.items()]
    lines += ["", "Which block each `mode` reads:", "", "| mode | block |", "|---|---|"]
    lines += [f"| `{mode}` | `{schema.BLOCKS[mode]}` |" for mode in schema.MODES]
    for model, paths in sections.items():
        lines += ["", f'<a id="{_anchor(model)}"></a>', "", f"## {_title(paths)}", ""]
        if len(paths) > 1:
            lines += ["Also at " + ", ".join(f"`{p}`" for p in paths[1:]) + ".", ""]
        lines += _model_doc(model, holders.get(model))
    return "\n".join(lines) + "\n"


def _blocks(root: type[BaseModel]) -> dict[type[BaseModel], list[str]]:
    """Every model reachable from `root`, in the order first met (depth first), → the key paths it sits at."""
    found: dict[type[BaseModel], list[str]] = {}

    def visit(model: type[BaseModel], path: str) -> None:
        if model in found:
            found[model].append(path)
            return
        found[model] = [path]
        for name, field in model.model_fields.items():
            for child, suffix in _nested(field.annotation):
                visit(child, f"{path}.{name}{suffix}".lstrip("."))

    visit(root, "")
    return found


def _holders(root: type[BaseModel]) -> dict[type[BaseModel], FieldInfo]:
    """Each model → the first key whose type holds it (its description introduces a model without a docstring)."""
    holders: dict[type[BaseModel], FieldInfo] = {}
    for model in _blocks(root):
        for field in model.model_fields.values():
            for child, _ in _nested(field.annotation):
                holders.setdefault(child, field)
    return holders


def _nested(annotation) -> list[tuple[type[BaseModel], str]]:
    """The models inside a field's type, each with the path suffix that reaches it ([] for a list, .NAME for a map)."""
    if _is_model(annotation):
        return [(annotation, "")]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in _nested(arg)]
    if origin is list:
        return [(m, "[]" + s) for m, s in _nested(args[0])]
    if origin is dict:
        return [(m, ".NAME" + s) for m, s in _nested(args[1])]
    return []


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _title(paths: list[str]) -> str:
    return f"`{paths[0]}`" if paths[0] else "Top level"


def _model_doc(model: type[BaseModel], holder: FieldInfo | None) -> list[str]:
    """The model's docstring (else its holder's description), then its keys grouped by the class that declares
    them (its own first)."""
    intro = _docstring(model) or (holder.description if holder is not None else "") or ""
    lines = [intro, ""] if intro else []
    owners = [c for c in model.__mro__ if _is_model(c) and c is not BaseModel and _own_fields(c, model)]
    for owner in owners:
        if len(owners) > 1:
            heading = f"`{owner.__name__}`" + (f": {_docstring(owner)}" if owner is not model else " keys")
            lines += [f"### {heading}", ""]
        lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
        for name in _own_fields(owner, model):
            field = model.model_fields[name]
            default = FILLED_BY_COMPOSE.get((model.__name__, name)) or _default(field)
            row = [f"`{name}`", _type(field.annotation), default, _bounds(field), _description(field)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |")
        lines.append("")
    return lines[:-1]


def _own_fields(owner: type[BaseModel], model: type[BaseModel]) -> list[str]:
    """`model`'s keys first declared by `owner` (the nearest class in the MRO that annotates them), in order."""
    def declarer(name: str) -> type:
        return next((c for c in model.__mro__ if name in c.__dict__.get("__annotations__", {})), model)
    return [name for name in model.model_fields if declarer(name) is owner]


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(doc.strip().split()) if doc.strip() else ""


def _type(annotation) -> str:
    """A field's type as a user reads it: int, float, str, bool, list[...], map of ..., literal values, null."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a constrained type, e.g. a map's key: the type, then its constraints
        constraints = _constraints(list(annotation.__metadata__), "characters" if args[0] is str else "items")
        return f"{_type(args[0])} ({constraints})" if constraints else _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(f"`{_yaml(a)}`" for a in args)
    if origin is list:
        return f"list of {_inner(args[0])}"
    if origin is dict:
        return f"map of {_inner(args[0])} → {_inner(args[1])}" if args else "map"
    if annotation is type(None):
        return "null"
    if annotation is dict:
        return "map"
    if _is_model(annotation):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    return {int: "int", float: "float", str: "str", bool: "bool"}.get(annotation, str(annotation))


def _inner(annotation) -> str:
    """A type inside a list or map: in parentheses when it is a choice, so `or` reads unambiguously."""
    text = _type(annotation)
    return f"({text})" if " or " in text else text


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, BaseModel):
        return "all defaults"
    return f"`{_yaml(value)}`"


def _yaml(value) -> str:
    """A value as it would be written in a manifest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int) and value == 2**63 - 1:
        return "2^63 − 1"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _description(field: FieldInfo) -> str:
    """The field's description, and whether it names an input file (the schema marks those with input_file)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    kind = extra.get("input_file")
    text = (field.description or "").replace("<", "&lt;")  # <runs_dir> is text, not an HTML tag
    return text + (f" *Input file ({kind}).*" if kind else "")


def _bounds(field: FieldInfo) -> str:
    return _constraints(field.metadata, "characters" if _mentions(field.annotation, str) else "items")


def _constraints(metadata: list, unit: str) -> str:
    """Bounds, lengths (in `unit`) and patterns, as words."""
    words = []
    for item in metadata:
        if isinstance(item, FieldInfo):  # Annotated[T, Field(...)]: its own constraints
            words += [_constraints(item.metadata, unit)]
            continue
        if isinstance(item, at.Ge):
            words.append(f"≥ {_yaml(item.ge)}")
        elif isinstance(item, at.Gt):
            words.append(f"> {_yaml(item.gt)}")
        elif isinstance(item, at.Le):
            words.append(f"≤ {_yaml(item.le)}")
        elif isinstance(item, at.Lt):
            words.append(f"< {_yaml(item.lt)}")
        elif isinstance(item, at.MinLen):
            words.append("not empty" if item.min_length == 1 else f"at least {item.min_length} {unit}")
        elif isinstance(item, at.MaxLen):
            words.append(f"at most {item.max_length} {unit}")
        elif getattr(item, "pattern", None):
            words.append(f"matches `{item.pattern}`")
    return ", ".join(words)


def _mentions(annotation, kind: type) -> bool:
    """`kind` is the annotation, or one of the choices of a union (not inside a list or map)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_mentions(arg, kind) for arg in typing.get_args(annotation))
    return annotation is kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.manifest.docgen", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.relative_to(DOC_PATH.parents[1])}")
    group.add_argument("--check", action="store_true", help="exit 1 if the file is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text, encoding="utf-8")
    elif args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            sys.stderr.write(f"docs/manifest.md is out of date with runner/manifest/schema.py: run {COMMAND}\n")
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
