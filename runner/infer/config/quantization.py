"""Weight quantizations as the manifest spells them (model.quantization, bench quantizations,
weight_candidates): the grammar, without torch. The kernels that run them are in `runner.infer.quant.weights`."""

from __future__ import annotations

import difflib

# Weight quantizations (model.quantization, bench quantizations, weight_candidates); int4 takes a group size option.
QUANTIZATIONS = ("none", "int8", "int8-dynamic", "int4", "gguf")  # gguf: a GGUF file's tensors as stored
INT4_GROUPS = (32, 64, 128)  # what torchao's int4 CPU kernel (tinygemm layout) takes
INT4_DEFAULT_GROUP = 64


def parse_quantization(text: str) -> tuple[str, dict]:
    """A weight quantization string → (name, options); ValueError naming the known ones.

    "int8" → ("int8", {}); "int4" → ("int4", {"group_size": 64, "embedding_bits": 4});
    "int4:g32:e8" → ("int4", {"group_size": 32, "embedding_bits": 8}): the embedding (and a head tied to it) in int8.
    """
    name, *fields = text.split(":")
    if name not in QUANTIZATIONS:
        close = difflib.get_close_matches(name.lower(), QUANTIZATIONS, n=1)  # INT8 → int8
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown quantization {text!r}: {hint}known: {', '.join(QUANTIZATIONS)} "
                         f"(int4 takes a group size, e.g. int4:g32)")
    if name != "int4":
        if fields:
            raise ValueError(f"quantization {name!r} takes no options (got {text!r})")
        return name, {}
    options = {"group_size": INT4_DEFAULT_GROUP, "embedding_bits": 4}
    keys = {"g": "group_size", "e": "embedding_bits"}
    seen: dict[str, str] = {}
    for field in fields:
        key, digits = keys.get(field[:1]), field[1:]
        if key is None or not (digits.isascii() and digits.isdigit()) or len(digits) > 6:
            raise ValueError(f"bad option in quantization {text!r}: expected int4:g<group size>[:e8], e.g. int4:g32 "
                             f"or int4:g32:e8 (the embedding in int8)")
        if key in seen:  # the last would silently win
            raise ValueError(f"quantization {text!r} gives option {field[:1]!r} twice ({seen[key]}, then {field}): "
                             f"give each option at most once")
        options[key], seen[key] = int(digits), field
    if options["group_size"] not in INT4_GROUPS:
        raise ValueError(f"quantization {text!r}: int4 group size must be one of "
                         f"{', '.join(map(str, INT4_GROUPS))} (got {options['group_size']})")
    if options["embedding_bits"] not in (4, 8):
        raise ValueError(f"quantization {text!r}: the embedding's bits must be 4 or 8 (e4, e8)")
    return name, options


def check_quantizations(values: list[str] | None) -> list[str] | None:
    """Every name known (a ValueError names the known ones); the list as given."""
    for quantization in values or []:
        parse_quantization(quantization)
    return values


def canonical_quantization(text: str) -> str:
    """The one spelling: `int4` → `int4:g64`, `int4:g32:e4` → `int4:g32`; the others as they are."""
    name, options = parse_quantization(text)
    if not options:
        return name
    return f"{name}:g{options['group_size']}" + (":e8" if options["embedding_bits"] == 8 else "")

