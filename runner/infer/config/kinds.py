"""Cache kinds and their options, as the manifest spells them: the grammar, without torch.

`parse_kind` turns a kind string into its canonical name and options; `canonical_kind` spells it back. The
classes that store each kind are in `runner.infer.cache`; this module is what `run check` needs to judge a
spelling.
"""

from __future__ import annotations

import difflib
import re

# The one dtype table: a model dtype's manifest name → the cache kind that stores K/V in that dtype.
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
KIND_NAMES = ("fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4", "kivi3", "kivi2")
KIND_ALIASES = {"q8": "q8_0", "q4": "q4_0"}
KIVI_BITS = {"kivi4": 4, "kivi3": 3, "kivi2": 2}
KIVI_OPTIONS = {"g": "group_size", "r": "residual_len", "s": "sinks", "o": "outlier_percent",
                "b": "value_block"}  # a letter, a number
KIVI_FLAGS = {"rot": "rotate_keys", "rotv": "rotate_values", "nuq": "nuq"}  # a word alone
VALUE_BLOCK = 32  # quant.BLOCK: values are quantized per token in blocks of this many channels unless b says otherwise
KIVI_DEFAULTS = {"sinks": 0, "outlier_percent": 0.0, "rotate_keys": False, "rotate_values": False, "nuq": False,
                 "value_block": VALUE_BLOCK}
KIVI_SPELLING = ("g<group>, r<residual>, s<sinks>, o<outlier %>, b<value block>, k<key bits>v<value bits>, rot, "
                 "rotv, nuq")
_SPLIT_BITS = re.compile(r"k([234])v([234])")  # "k4v2": keys at 4 bits, values at 2
_CODES_PER_UNIT = {2: 4, 3: 8, 4: 2}  # quant.CODES_PER_UNIT (this module imports no torch)
# What a budget that fits only 3 or 2 bits can still pass the default gates with (docs/performance.md#kivi-options,
# SmolLM2, 3 windows: keys at 4 bits over groups of 128, values at 3 in blocks of 64, sinks: ΔNLL 0.010 / KL 0.011 at
# 0.231× (plain kivi3: 0.042 / 0.039 at 0.25×); kivi2 with sinks, 2 % outliers, values in blocks of 64, fitted codes
# ΔNLL 0.072 / KL 0.096 at 0.181×).
BEST_KIVI3, BEST_KIVI2 = "kivi3:k4v3:g128:r128:s4:b64", "kivi2:g128:r128:s4:o2:b64:nuq"
DEFAULT_CANDIDATES = ("fp16", "q8_0", "kivi4", "q4_1", "nf4", "q4_0", BEST_KIVI3, "kivi2", BEST_KIVI2)


def torch_dtype(name: str):
    """The torch dtype of a manifest dtype name ("bfloat16") or a plain cache kind ("bf16")."""
    import torch  # here, not at the top: the manifest schema imports this module without torch

    return getattr(torch, {kind: dtype for dtype, kind in DTYPES.items()}.get(name, name))


def kivi_options(bits: int, group_size: int, residual_len: int | None) -> dict:
    """{"group_size", "residual_len"} checked: codes fill whole bytes, the residual holds whole groups."""
    residual_len = group_size if residual_len is None else residual_len
    per_byte = _CODES_PER_UNIT[bits]
    if group_size <= 0 or group_size % per_byte:
        raise ValueError(f"KIVI group size must be a positive multiple of {per_byte} at {bits} bits (got {group_size})")
    if residual_len <= 0 or residual_len % group_size:
        raise ValueError(f"KIVI residual length must be a positive multiple of the group size {group_size} "
                         f"(got {residual_len})")
    return {"group_size": group_size, "residual_len": residual_len}


def parse_kind(kind: str | None) -> tuple[str | None, dict]:
    """A kind string → (canonical name, options); None → (None, {}). ValueError for anything unknown or bad.

    "q4" → ("q4_0", {}); "kivi4" → ("kivi4", {"group_size": 32, "residual_len": 32, **KIVI_DEFAULTS});
    "kivi3:g64:r128:s4:o1:rot:nuq" → group 64, residual 128, 4 sinks, 1 % outliers, rotated keys, fitted codes;
    "kivi3:k4v2:b64" → keys at 4 bits, values at 2 in blocks of 64 channels (the name's bits are the average of
    key and value bits, rounded down). r defaults to g; each option at most once, in any order. Options always
    hold key_bits and value_bits.
    """
    if kind is None:
        return None, {}
    name, *fields = kind.split(":")
    name = KIND_ALIASES.get(name, name)
    if name not in KIND_NAMES:
        close = difflib.get_close_matches(name, KIND_NAMES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown cache kind {kind!r}: {hint}known: {', '.join(KIND_NAMES)} (aliases q8, q4; "
                         f"kivi options as in kivi4:g32:r128)")
    if name not in KIVI_BITS:
        if fields:
            raise ValueError(f"cache kind {name!r} takes no options (got {kind!r})")
        return name, {}
    given: dict = {}
    for field in fields:
        option, value = _kivi_field(field)
        if option is None or option in given:
            close = difflib.get_close_matches(field, [*KIVI_FLAGS, "g32", "r128", "s4", "o1"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close and option is None else ""
            raise ValueError(f"bad option {field!r} in cache kind {kind!r}{hint}: expected {KIVI_SPELLING}, each at "
                             f"most once, e.g. {name}:g32:r128:s4:o1")
        given[option] = value
    bits = KIVI_BITS[name]
    key_bits, value_bits = given.pop("split_bits", (bits, bits))
    block = given.get("value_block", VALUE_BLOCK)
    try:
        if (key_bits + value_bits) // 2 != bits:
            raise ValueError(f"key and value bits k{key_bits}v{value_bits} average {(key_bits + value_bits) / 2:g}: "
                             f"{name} takes splits whose average rounds down to {bits}, e.g. k4v2, k4v3 for kivi3")
        options = kivi_options(key_bits, given.pop("group_size", 32), given.pop("residual_len", None))
        if block <= 0 or block % _CODES_PER_UNIT[value_bits]:
            raise ValueError(f"the value block (b) must be a positive multiple of {_CODES_PER_UNIT[value_bits]} at "
                             f"{value_bits} bits (got {block})")
    except ValueError as error:
        raise ValueError(f"cache kind {kind!r}: {error}") from None
    if not 0 <= given.get("outlier_percent", 0) <= 50:
        raise ValueError(f"cache kind {kind!r}: the outlier percentage (o) must be between 0 and 50")
    return name, {**options, **KIVI_DEFAULTS, **given, "key_bits": key_bits, "value_bits": value_bits}


def _kivi_field(field: str) -> tuple[str | None, object]:
    """One ':'-separated KIVI option → (option name, value), or (None, None) when it is not one."""
    if field in KIVI_FLAGS:
        return KIVI_FLAGS[field], True
    if split := _SPLIT_BITS.fullmatch(field):
        return "split_bits", (int(split[1]), int(split[2]))
    option, number = KIVI_OPTIONS.get(field[:1]), field[1:]
    if option is None or not number.isascii():
        return None, None
    if option == "outlier_percent":
        whole, _, fraction = number.partition(".")
        return (option, float(number)) if whole.isdigit() and (not fraction or fraction.isdigit()) else (None, None)
    return (option, int(number)) if number.isdigit() else (None, None)


def canonical_kind(kind: str) -> str:
    """The one spelling of a kind: aliases resolved, KIVI options spelled out (`kivi4` → `kivi4:g32:r32`, the
    other options after g and r in a fixed order, only when not their default)."""
    name, options = parse_kind(kind)
    if not options:
        return name
    split = (options["key_bits"], options["value_bits"]) != (KIVI_BITS[name],) * 2
    extras = [f"s{options['sinks']}" if options["sinks"] else "",
              f"o{options['outlier_percent']:g}" if options["outlier_percent"] else "",
              f"b{options['value_block']}" if options["value_block"] != VALUE_BLOCK else "",
              f"k{options['key_bits']}v{options['value_bits']}" if split else "",
              *[flag for flag, option in KIVI_FLAGS.items() if options[option]]]
    return ":".join([name, f"g{options['group_size']}", f"r{options['residual_len']}", *filter(None, extras)])


def checked_kind(value: str | None) -> str | None:
    if value is None or value == "auto":
        return value
    parse_kind(value)  # ValueError → a schema error naming the known kinds
    return value

