"""What a manifest value may look like beyond its type, decided once for the validator and the JSON Schema.

`run schema` prints the JSON Schema editors check manifests against; a value the validator takes but the schema
refuses makes an editor flag a valid manifest. So every leniency of the validator is written here once, as a
predicate on a field or a model, and used twice: by the validator (blocks.py) and by the schema hook (`schema_hook`,
installed on every manifest model through its model_config):
  - ONE OR MANY: a list of plain values (str, numbers, booleans, literals) also takes one value, which becomes a
    one-element list (`quantizations: none` is `[none]`, `cache_kinds: fp16` is `[fp16]`): one rule for every
    such list field. A list of blocks (targets, runs) does not: a single block there is a mistake.
  - SHORTHAND: a model block also takes a string, its id (`model: zoo:smollm2-135m`); a serve block's token counts
    take an integer, a fixed count (`prompt_tokens: 256`).
  - FILLED IN: keys the loader fills in before validation (`name`, the file's stem) are not required in a file.
No torch, no hydra.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PLAIN = (str, int, float, bool)
FILLED_IN = {("Manifest", "name"): "the file's stem"}  # runner/manifest/compose.py: raw.setdefault("name", ...)
SHORTHAND = {"ModelBlock": {"type": "string", "minLength": 1, "description": "A model id alone: {id: ...}."},
             "LengthsBlock": {"type": "integer", "minimum": 1, "maximum": 1_000_000,
                              "description": "A count alone: {dist: fixed, value: ...}."}}


def one_or_many(field: FieldInfo) -> bool:
    """The field is a list of plain values (optionally None) and nothing else: one value alone stands for a list."""
    args = [a for a in (typing.get_args(field.annotation) if typing.get_origin(field.annotation) in
                        (typing.Union, types.UnionType) else (field.annotation,)) if a is not type(None)]
    if len(args) != 1 or typing.get_origin(args[0]) is not list:
        return False
    (item,) = typing.get_args(args[0]) or (Any,)
    return _plain(item)


def _plain(annotation) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:
        return _plain(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is Literal:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return all(_plain(a) for a in typing.get_args(annotation))
    return annotation in PLAIN


def as_list(field: FieldInfo | None, value):
    """The validator's half of ONE OR MANY: a plain value given where a list of plain values goes → [value]."""
    if field is not None and isinstance(value, PLAIN) and one_or_many(field):
        return [value]
    return value


def schema_hook(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The schema's half: each ONE OR MANY field's property also takes its item; SHORTHAND and FILLED IN applied."""
    properties = schema.get("properties", {})
    for name, field in cls.model_fields.items():
        if name in properties and one_or_many(field):
            properties[name] = _item_or_list(properties[name])
    required = [r for r in schema.get("required", []) if (cls.__name__, r) not in FILLED_IN]
    if "required" in schema:
        if required:
            schema["required"] = required
        else:
            del schema["required"]
    if cls.__name__ in SHORTHAND:
        whole = dict(schema)
        keep: dict[str, Any] = {k: whole.pop(k) for k in ("title", "description") if k in whole}
        schema.clear()
        schema.update(keep, anyOf=[SHORTHAND[cls.__name__], whole])


ARRAY_KEYS = ("type", "items", "minItems", "maxItems")


def _item_or_list(prop: dict[str, Any]) -> dict[str, Any]:
    """{type: array, items: X, ...} (alone or inside anyOf) → anyOf [X, the array, ...]."""
    prop = dict(prop)
    if prop.get("type") == "array":
        array = {k: prop.pop(k) for k in ARRAY_KEYS if k in prop}
        prop["anyOf"] = [array.get("items", {}), array]
    elif "anyOf" in prop:
        options = []
        for option in prop["anyOf"]:
            options += [option.get("items", {}), option] if option.get("type") == "array" else [option]
        prop["anyOf"] = options
    return prop
