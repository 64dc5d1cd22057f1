"""KV eviction as a cache option, as the manifest spells it: the grammar, without torch.

Eviction is the part of a cache kind after a `+`, so every path that takes a kind carries it (make_cache,
estimate_cache_bytes, autocache candidates, cache plans keyed on `KindOptions.canonical`, the manifest):

    <kind>+<method>:<ratio>[:s<sinks>][:w<window>][:e<every>]
    q8_0+snapkv:0.5    fp16+streaming:0.75:s4:w64    kivi4:g32:r32+knorm:0.5    q4_0+snapkv:0.5:e16

`ratio` is kvpress's `compression_ratio`: the fraction of a prompt forward's tokens removed, in (0, 1); the
forward keeps ceil(T·(1 − ratio)) of its T tokens per (row, KV head). Options, a letter and a number each:
    s<sinks>   the first tokens of the prompt forward, always kept (StreamingLLM's and Expected Attention's sinks)
    w<window>  the newest tokens, always kept; SnapKV scores with the queries of this window
    e<every>   decoding schedule (kvpress's DecodingPress): every N decode steps, a layer holding more than its
               size after the prompt forward is compressed back to it, scored with the queries of the last N tokens
Methods (runner.infer.cache.eviction scores them): streaming, h2o, snapkv, tova, knorm, expected.
Owns `EvictionOptions`, `parse_eviction`, and the one decision on what eviction the compiled engine (and
speculative decoding) refuses, with its reason (`compiled_eviction_reason`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction

METHODS = ("streaming", "h2o", "snapkv", "tova", "knorm", "expected")
EVICTION_OPTIONS = {"s": "sinks", "w": "window", "e": "every"}
EVICTION_SPELLING = "<method>:<ratio in (0, 1)>[:s<sinks>][:w<window>][:e<every N decode steps>]"
# Each method's defaults, as kvpress's presses have them: StreamingLLM and Expected Attention keep 4 sinks,
# SnapKV observes (and keeps) a window of 64 queries, TOVA keeps the last query's token; 0 = none.
DEFAULTS = {"streaming": {"sinks": 4}, "expected": {"sinks": 4}, "snapkv": {"window": 64}, "tova": {"window": 1}}
OPTION_MAX = 10_000_000  # tokens: max_seq_len's bound


@dataclass(frozen=True)
class EvictionOptions:
    """One eviction method and its options, checked. `sinks` / `window` −1 take the method's default
    (DEFAULTS); two spellings of the same eviction give equal options. ValueError for anything bad."""

    method: str
    ratio: float
    sinks: int = -1  # -1: the method's default
    window: int = -1
    every: int = 0  # 0: no decoding schedule

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown eviction method {self.method!r}{_hint(self.method, METHODS)}: known: "
                             f"{', '.join(METHODS)}")
        if not 0 < self.ratio < 1:
            raise ValueError(f"the eviction ratio is the fraction of the prompt's tokens removed: it must lie in "
                             f"the open interval (0, 1) (got {self.ratio:g})")
        for name in ("sinks", "window"):
            if getattr(self, name) == -1:
                object.__setattr__(self, name, DEFAULTS.get(self.method, {}).get(name, 0))
        for name in ("sinks", "window", "every"):
            value = getattr(self, name)
            if not 0 <= value <= OPTION_MAX:
                raise ValueError(f"eviction option {name} must be between 0 and {OPTION_MAX:,} (got {value})")

    @property
    def canonical(self) -> str:
        """`method:ratio`, then s, w, e when not the method's default (in that order)."""
        defaults = DEFAULTS.get(self.method, {})
        extras = [f"{letter}{getattr(self, name)}" for letter, name in EVICTION_OPTIONS.items()
                  if getattr(self, name) != defaults.get(name, 0)]
        return ":".join([self.method, f"{self.ratio:g}", *extras])

    def kept(self, tokens: int) -> int:
        """Tokens a prompt forward of `tokens` keeps: ceil(tokens · (1 − ratio)), at least 1 (exact in the
        decimal ratio as spelt: 0.3 of 10 removes 3, never 2 by float rounding)."""
        removed = int(tokens * Fraction(repr(self.ratio)))
        return max(1, tokens - removed) if tokens else 0

    def held(self, prompt: int, generated: int) -> int:
        """Tokens a layer holds after one prompt forward of `prompt` tokens and `generated` decode steps: the
        kept prompt, plus the generated tokens since the schedule last compressed back (e<every>)."""
        target = self.kept(prompt)
        if not self.every:
            return target + generated
        return target + generated % self.every


def parse_eviction(text: str) -> EvictionOptions:
    """`snapkv:0.5:w32:e16` → EvictionOptions. ValueError naming what was expected and the closest method."""
    method, *fields = text.split(":")
    if method not in METHODS:
        raise ValueError(f"unknown eviction method {method!r}{_hint(method, METHODS)}: expected "
                         f"{EVICTION_SPELLING}, methods {', '.join(METHODS)}")
    if not fields:
        raise ValueError(f"eviction {text!r} names no ratio: expected {EVICTION_SPELLING}, e.g. {method}:0.5")
    ratio_text, *options = fields
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"eviction {text!r}: the ratio {ratio_text!r} is not a number: expected "
                         f"{EVICTION_SPELLING}, e.g. {method}:0.5") from None
    if ratio != ratio or not 0 < ratio < 1:  # NaN too
        raise ValueError(f"eviction {text!r}: the ratio {ratio_text} is outside the open interval (0, 1): it is "
                         f"the fraction of the prompt's tokens removed (kvpress's compression_ratio)")
    given: dict[str, int] = {}
    for part in options:
        name, number = EVICTION_OPTIONS.get(part[:1]), part[1:]
        if name is None or not (number.isascii() and number.isdigit()):
            raise ValueError(f"bad eviction option {part!r} in {text!r}{_hint(part, ['s4', 'w64', 'e16'])}: "
                             f"expected {EVICTION_SPELLING}, each option at most once")
        if name in given:
            raise ValueError(f"eviction {text!r} gives option {part[:1]!r} twice: give each option at most once")
        if len(number) > 12:
            number = str(OPTION_MAX + 1)  # said so below; never a 4,300-digit int()
        given[name] = int(number)
    try:
        return EvictionOptions(method, ratio, **given)
    except ValueError as error:
        raise ValueError(f"eviction {text!r}: {error}") from None


USES = ("decode", "serve", "speculative")  # what asks compiled_eviction_reason: the engine's decoding, its server,
# speculative decoding


def compiled_eviction_reason(kind: str | None, use: str = "decode", prefill: str = "eager") -> str:
    """Why the compiled engine cannot run `kind`, when it has eviction, or "": the one decision, here without
    torch so that `run check` and the compiled engine (its Generator states, its server) say the same. `use`: what
    runs it (USES); `prefill`: the config's prefill ("compiled": the prompt in compiled pieces).

    It can: a float or block kind (fp32 / fp16 / bf16, q8_0 / q4_0 / q4_1 / nf4) evicting at each prompt forward,
    prefilled eagerly into the static cache, which is then compacted in place (compiled/state.py)."""
    if kind is None or "+" not in kind:
        return ""
    base, _, spelt = kind.partition("+")
    head = f"cache kind {kind!r} evicts tokens"
    if base.split(":")[0].startswith("kivi"):
        return (f"{head} from a KIVI cache: the compiled engine's static KIVI layout codes keys over groups of columns "
                f"and keeps its residual in a ring indexed by column, so kept tokens cannot be moved to other columns "
                f"without coding them again; use engine: eager (which codes the kept tokens as if fed alone), or a "
                f"float or block kind (fp16, q8_0, q4_0, q4_1, nf4) with eviction")
    if use == "serve":
        return (f"{head}: the compiled continuous-batching server's rows share one column pointer and join at any "
                f"column, and eviction moves each row's kept tokens to its first columns at its own prefill; serve "
                f"it with the eager scheduler, or decode it with mode generate on engine: compiled")
    if use == "speculative":
        return speculative_eviction_reason(kind)
    try:
        options = parse_eviction(spelt)
    except ValueError:
        return ""  # a misspelt eviction is parse_kind's error to report, not a refusal
    if options.every:
        return (f"{head} on a decoding schedule (e{options.every}): the compiled engine compacts its static cache "
                f"only after a prompt forward, never between its compiled decode steps (whose every shape and "
                f"column are fixed); use engine: eager, or drop the :e{options.every}")
    if prefill == "compiled":
        return (f"{head}: prefill: compiled feeds the prompt in pieces of at most 512 columns padded on the right, "
                f"and eviction scores each prompt forward as a whole (as the eager engine does); use prefill: eager "
                f"(the compiled engine then prefills in one static forward and evicts at its end)")
    return ""


def speculative_eviction_reason(kind: str | None) -> str:
    """Why speculative decoding cannot run `kind` (on either engine), when it has eviction, or ""."""
    if kind is None or "+" not in kind:
        return ""
    return (f"cache kind {kind!r} evicts tokens: speculative decoding verifies chunks of draft tokens, which "
            f"eviction would score and thin as if they were a prompt, places tokens by the cache's length and rolls "
            f"back by cropping columns; decode it without speculation")


def _hint(word: str, known) -> str:
    close = difflib.get_close_matches(word.lower(), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
