"""Cache kinds and their options, as the manifest spells them: the grammar, without torch.

`parse_kind` turns a kind string into one frozen `KindOptions` (canonical name, family, KIVI options), which every
layer and estimator takes; `KindOptions.canonical` (and `canonical_kind`) spells it back. The classes that store
each kind are named in `runner.infer.cache.registry`; this module is what `run check` needs to judge a spelling,
so it holds the format constants the grammar checks (BLOCK, CODES_PER_UNIT) and `quant.formats` imports them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field, fields
from typing import NamedTuple, overload

from runner.infer.config.eviction import EvictionOptions, compiled_eviction_reason, parse_eviction

# The one dtype table: a model dtype's manifest name → the cache kind that stores K/V in that dtype.
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
KIND_NAMES = ("fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4", "kivi3", "kivi2")
KIND_ALIASES = {"q8": "q8_0", "q4": "q4_0"}
KIVI_BITS = {"kivi4": 4, "kivi3": 3, "kivi2": 2}
FAMILIES = {**dict.fromkeys(DTYPES.values(), "float"), **dict.fromkeys(("q8_0", "q4_0", "q4_1", "nf4"), "block"),
            **dict.fromkeys(KIVI_BITS, "kivi")}
BLOCK = 32  # the block kinds quantize blocks of this many channels; KIVI's values too, unless b says otherwise
CODES_PER_UNIT = {2: 4, 3: 8, 4: 2}  # codes that fill whole bytes: a byte (2, 4 bits) or three bytes (3 bits)
KIVI_OPTIONS = {"g": "group_size", "r": "residual_len", "s": "sinks", "o": "outlier_percent",
                "b": "value_block"}  # a letter, a number
KIVI_FLAGS = {"rot": "rotate_keys", "rotv": "rotate_values", "nuq": "nuq"}  # a word alone
KIVI_SPELLING = ("g<group>, r<residual>, s<sinks>, o<outlier %>, b<value block>, k<key bits>v<value bits>, rot, "
                 "rotv, nuq")
OPTION_MAX = {"group_size": 10_000_000, "residual_len": 10_000_000, "sinks": 10_000_000,  # max_seq_len's bound
              "value_block": 4096}  # channels: no attention head has more
_SPLIT_BITS = re.compile(r"k([234])v([234])")  # "k4v2": keys at 4 bits, values at 2
# What a budget that fits only 3 or 2 bits can still pass the default gates with (docs/performance.md#kivi-options):
# keys at 4 bits over groups of 128, values at 3 in blocks of 64, sinks; kivi2 with sinks, 2 % outliers, values in
# blocks of 64 and fitted codes.
BEST_KIVI3, BEST_KIVI2 = "kivi3:k4v3:g128:r128:s4:b64", "kivi2:g128:r128:s4:o2:b64:nuq"
DEFAULT_CANDIDATES = ("fp16", "q8_0", "kivi4", "q4_1", "nf4", "q4_0", BEST_KIVI3, "kivi2", BEST_KIVI2)


def torch_dtype(name: str):
    """The torch dtype of a manifest dtype name ("bfloat16") or a plain cache kind ("bf16")."""
    import torch  # here, not at the top: the manifest schema imports this module without torch

    return getattr(torch, {kind: dtype for dtype, kind in DTYPES.items()}.get(name, name))


class KiviFields(NamedTuple):
    """A KIVI kind's numeric options as `KindOptions.__post_init__` fills them in: never None."""

    key_bits: int
    value_bits: int
    group_size: int
    residual_len: int


@dataclass(frozen=True)
class KindOptions:
    """One cache kind and its options, checked: what every layer, static layer and estimator is built from.

    `name` is canonical (aliases resolved). The KIVI fields apply to KIVI kinds only; there a None is filled in:
    key_bits / value_bits the name's bits, group_size 32, residual_len the group size. Two spellings of the same
    kind give equal (and equally hashed) options. ValueError for anything unknown or inconsistent.
    """

    name: str
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int | None = None
    residual_len: int | None = None
    sinks: int = 0
    outlier_percent: float = 0.0
    rotate_keys: bool = False
    rotate_values: bool = False
    nuq: bool = False
    value_block: int = BLOCK
    eviction: EvictionOptions | None = None  # tokens dropped after a prompt forward (config/eviction.py)
    family: str = field(init=False)  # float, block or kivi: which registry entries share their classes

    def __post_init__(self) -> None:
        if self.name not in FAMILIES:
            raise ValueError(f"unknown cache kind {self.name!r}: known: {', '.join(KIND_NAMES)}")
        object.__setattr__(self, "family", FAMILIES[self.name])
        if self.family != "kivi":
            if any(getattr(self, f.name) != f.default for f in fields(self)
                   if f.init and f.name not in ("name", "eviction")):
                raise ValueError(f"cache kind {self.name!r} takes no options")
            return
        bits = KIVI_BITS[self.name]  # the kivi family is exactly KIVI_BITS's names
        key_bits, value_bits = self.key_bits or bits, self.value_bits or bits
        group = 32 if self.group_size is None else self.group_size
        residual = group if self.residual_len is None else self.residual_len
        for name, value in (("key_bits", key_bits), ("value_bits", value_bits), ("group_size", group),
                            ("residual_len", residual)):
            object.__setattr__(self, name, value)
        if (key_bits + value_bits) // 2 != bits:
            raise ValueError(f"key and value bits k{key_bits}v{value_bits} average {(key_bits + value_bits) / 2:g}: "
                             f"{self.name} takes splits whose average rounds down to {bits}, e.g. k4v2, k4v3 for "
                             f"kivi3")
        per_unit = CODES_PER_UNIT[key_bits]
        if group <= 0 or group % per_unit:
            raise ValueError(f"KIVI group size must be a positive multiple of {per_unit} at {key_bits} bits (got "
                             f"{group})")
        if residual <= 0 or residual % group:
            raise ValueError(f"KIVI residual length must be a positive multiple of the group size {group} "
                             f"(got {residual})")
        if self.value_block <= 0 or self.value_block % CODES_PER_UNIT[value_bits]:
            raise ValueError(f"the value block (b) must be a positive multiple of {CODES_PER_UNIT[value_bits]} at "
                             f"{value_bits} bits (got {self.value_block})")
        if not 0 <= self.outlier_percent <= 50:
            raise ValueError("the outlier percentage (o) must be between 0 and 50")

    @property
    def bits(self) -> int | None:
        """A KIVI kind's bits (the name's: the average of key and value bits, rounded down); None otherwise."""
        return KIVI_BITS.get(self.name)

    @property
    def kivi(self) -> KiviFields:
        """key_bits, value_bits, group_size and residual_len as ints (filled in for every KIVI kind).
        ValueError for a kind of another family, which has none."""
        if (self.family != "kivi" or self.key_bits is None or self.value_bits is None or self.group_size is None
                or self.residual_len is None):
            raise ValueError(f"cache kind {self.name!r} is not a KIVI kind: it has no KIVI options")
        return KiviFields(self.key_bits, self.value_bits, self.group_size, self.residual_len)

    @property
    def canonical(self) -> str:
        """The one spelling: aliases resolved, KIVI options spelled out (`kivi4` → `kivi4:g32:r32`, the other
        options after g and r in a fixed order, only when not their default), then `+` and the eviction's
        canonical spelling when it has one. Cache plans key on it."""
        evict = f"+{self.eviction.canonical}" if self.eviction is not None else ""
        if self.family != "kivi":
            return self.name + evict
        split = (self.key_bits, self.value_bits) != (self.bits,) * 2
        extras = [f"s{self.sinks}" if self.sinks else "",
                  f"o{self.outlier_percent:g}" if self.outlier_percent else "",
                  f"b{self.value_block}" if self.value_block != BLOCK else "",
                  f"k{self.key_bits}v{self.value_bits}" if split else "",
                  *[flag for flag, option in KIVI_FLAGS.items() if getattr(self, option)]]
        return ":".join([self.name, f"g{self.group_size}", f"r{self.residual_len}", *filter(None, extras)]) + evict


@overload
def parse_kind(kind: str) -> KindOptions: ...
@overload
def parse_kind(kind: None) -> None: ...
def parse_kind(kind: str | None) -> KindOptions | None:
    """A kind string → its KindOptions; None → None (the model's own dtype). ValueError for anything unknown or bad.

    "q4" → q4_0; "kivi4" → group 32, residual 32, both sides at 4 bits, no other option;
    "kivi3:g64:r128:s4:o1:rot:nuq" → group 64, residual 128, 4 sinks, 1 % outliers, rotated keys, fitted codes;
    "kivi3:k4v2:b64" → keys at 4 bits, values at 2 in blocks of 64 channels (the name's bits are the average of
    key and value bits, rounded down). r defaults to g; each option at most once, in any order.
    "q8_0+snapkv:0.5" → q8_0 with SnapKV eviction of half the prompt (config/eviction.py's grammar after the `+`).
    """
    if kind is None:
        return None
    kind, plus, evict = kind.partition("+")
    if plus:
        try:
            eviction = parse_eviction(evict)
        except ValueError as error:
            raise ValueError(f"cache kind {kind + plus + evict!r}: {error}") from None
        return dataclasses.replace(parse_kind(kind), eviction=eviction)
    name, *fields = kind.split(":")
    name = KIND_ALIASES.get(name, name)
    if name not in KIND_NAMES:
        close = difflib.get_close_matches(name.lower(), KIND_NAMES, n=1)  # FP16 → fp16
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown cache kind {kind!r}: {hint}known: {', '.join(KIND_NAMES)} (aliases q8, q4; "
                         f"kivi options as in kivi4:g32:r128)")
    if name not in KIVI_BITS:
        if fields:
            raise ValueError(f"cache kind {name!r} takes no options (got {kind!r})")
        return KindOptions(name)
    given: dict = {}
    spelt: dict = {}
    for part in fields:
        option, value = _kivi_field(part)
        if option in given:  # the last would silently win
            raise ValueError(f"cache kind {kind!r} gives option {_letter(part)!r} twice ({spelt[option]}, then "
                             f"{part}): give each option at most once")
        if option is None:
            close = difflib.get_close_matches(part, [*KIVI_FLAGS, "g32", "r128", "s4", "o1"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"bad option {part!r} in cache kind {kind!r}{hint}: expected {KIVI_SPELLING}, each at "
                             f"most once, e.g. {name}:g32:r128:s4:o1")
        if isinstance(value, int) and not isinstance(value, bool) and value > OPTION_MAX.get(option, value):
            raise ValueError(f"cache kind {kind!r}: {part} is far beyond what a cache holds ({option} at most "
                             f"{OPTION_MAX[option]:,})")
        given[option], spelt[option] = value, part
    key_bits, value_bits = given.pop("split_bits", (None, None))
    try:
        return KindOptions(name, key_bits=key_bits, value_bits=value_bits, **given)
    except ValueError as error:
        raise ValueError(f"cache kind {kind!r}: {error}") from None


def compiled_serve_reason(kind: str | None) -> str:
    """Why `kind` cannot be served by continuous batching on the compiled engine (serve/compiled_slots.py), or ""
    when it can: here, without torch, so `run check` judges a serve block's engines as the server does."""
    if reason := compiled_eviction_reason(kind, use="serve"):
        return reason
    options = parse_kind(kind)
    if options is not None and options.family == "kivi" and options.sinks:
        return (f"KIVI with sinks (s{options.sinks}) keeps them in the static cache's first columns, and the slots' "
                f"rows start at other columns (the eager scheduler serves it; without sinks the compiled one does)")
    return ""


def speculative_serve_reason(kind: str | None) -> str:
    """Why continuous batching cannot speculate (serve/scheduler.py) on `kind`, or "" when it can."""
    options = parse_kind(kind)
    if options is not None and options.family == "kivi":
        return ("speculation needs a kind that stores each token alone: KIVI codes groups of tokens, "
                "which a rejected draft would leave coded")
    return ""


def _letter(part: str) -> str:
    """The option a KIVI field spells: its letter (g, r, s, o, b), k..v for split bits, or the flag itself."""
    return part if part in KIVI_FLAGS else "k..v" if _SPLIT_BITS.fullmatch(part) else part[:1]


def seq_len_problem(kind: str | None, max_seq_len: int, what: str = "max_seq_len") -> str | None:
    """Why a KIVI kind's token counts cannot fit a cache of `max_seq_len` tokens (sinks, residual window), or
    None. Checked with the manifest, so that a typo such as s40000 is an error there, not an allocation later."""
    options = parse_kind(kind) if kind not in (None, "auto") else None
    if options is None or options.family != "kivi":
        return None
    residual = options.kivi.residual_len
    if options.sinks >= max_seq_len:
        return (f"cache kind {kind!r}: {options.sinks} sink tokens (s{options.sinks}) leave no room in {what} "
                f"{max_seq_len}")
    kind_part = str(kind).partition("+")[0]  # the eviction's options are not the kind's
    written = any(_letter(part) == "r" for part in kind_part.split(":")[1:])  # the default window fits any cache
    if written and residual > max_seq_len:
        return (f"cache kind {kind!r}: the residual window r{residual} is longer than {what} {max_seq_len} "
                f"(nothing would ever be quantized)")
    return None


def _kivi_field(part: str) -> tuple[str | None, object]:
    """One ':'-separated KIVI option → (option name, value), or (None, None) when it is not one."""
    if part in KIVI_FLAGS:
        return KIVI_FLAGS[part], True
    if split := _SPLIT_BITS.fullmatch(part):
        return "split_bits", (int(split[1]), int(split[2]))
    option, number = KIVI_OPTIONS.get(part[:1]), part[1:]
    if option is None or not number.isascii():
        return None, None
    if len(number) > 12 and number.isdigit():
        return option, 10**12  # far past OPTION_MAX, said so; never a 4,300-digit int() or a 64-bit overflow
    if option == "outlier_percent":
        whole, _, fraction = number.partition(".")
        return (option, float(number)) if whole.isdigit() and (not fraction or fraction.isdigit()) else (None, None)
    return (option, int(number)) if number.isdigit() else (None, None)


def canonical_kind(kind: str) -> str:
    """The one spelling of a kind (`KindOptions.canonical`): `kivi4` → `kivi4:g32:r32`."""
    return parse_kind(kind).canonical


@overload
def checked_kind(value: str) -> str: ...
@overload
def checked_kind(value: None) -> None: ...
def checked_kind(value: str | None) -> str | None:
    if value is None or value == "auto":
        return value
    parse_kind(value)  # ValueError → a schema error naming the known kinds
    return value

