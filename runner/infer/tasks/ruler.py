"""RULER's synthetic long-context tasks (NVIDIA/RULER, scripts/data/synthetic/), generated offline and seeded.

Owns: the task table (`TASKS`: RULER's `synthetic.yaml` less the QA tasks), one generator per family (needle in a
haystack, variable tracking, common words, frequent words) and the sizing of a sample to a token length: the number of
haystack units (noise sentences, essay words, distractor needles, listed words) is found by binary search on the
tokenizer's count of the whole prompt, the largest that keeps it at most `length` tokens, as RULER does.
Each sample is deterministic from (task, length, seed, index): every draw comes from one `random.Random` seeded by
those four, made afresh for each haystack size tried, so the search changes the haystack's size and nothing else.
The prompt is RULER's `base` template (the task's template followed by its answer prefix); no chat template is
applied. Its token count is `len(tokenizer(prompt).input_ids)`: with the special tokens the tokenizer adds (a BOS
where it adds one), which is exactly what `evaluate` feeds the model.
Does not know about models, caches or scores (the metric is named here, computed in `scoring`).
"""

from __future__ import annotations

import difflib
import itertools
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runner.infer.config.tasks import ANSWER_TOKENS
from runner.infer.loading.texts import load_text
from runner.infer.tasks.words import WordLists, word_lists

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [int(math.floor(100 * i / 39 + 0.5)) for i in range(40)]  # RULER's np.round(np.linspace(0, 100, 40))

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
VT_ICL_NOISE = 16  # noise sentences in vt's one worked example (RULER sizes it to about 500 tokens)


@dataclass(frozen=True)
class Task:
    """One RULER task: its family, RULER's arguments for it (`synthetic.yaml`), tokens to generate, metric."""

    name: str
    family: str  # niah | vt | cwe | fwe
    max_new_tokens: int  # RULER's tokens_to_generate for the family
    metric: str = "string_match_all"
    args: dict = field(default_factory=dict)


def _niah(name: str, haystack: str, key: str = "words", value: str = "numbers", k: int = 1, v: int = 1,
          q: int = 1) -> Task:
    return Task(name, "niah", ANSWER_TOKENS[name], args={"haystack": haystack, "key": key, "value": value,
                                                         "keys": max(k, q), "values": v, "queries": q})


TASKS: dict[str, Task] = {t.name: t for t in [
    _niah("niah_single_1", "noise"),
    _niah("niah_single_2", "essay"),
    _niah("niah_single_3", "essay", value="uuids"),
    _niah("niah_multikey_1", "essay", k=4),
    _niah("niah_multikey_2", "needle"),
    _niah("niah_multikey_3", "needle", key="uuids", value="uuids"),
    _niah("niah_multivalue", "essay", v=4),
    _niah("niah_multiquery", "essay", q=4),
    Task("vt", "vt", ANSWER_TOKENS["vt"], args={"chains": 1, "hops": 4}),
    Task("cwe", "cwe", ANSWER_TOKENS["cwe"], args={"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    Task("fwe", "fwe", ANSWER_TOKENS["fwe"], args={"alpha": 2.0, "coded_wordlen": 6}),
]}


@dataclass(frozen=True)
class Sample:
    """One prompt of a task at a length: what the model reads and what a right answer contains."""

    task: str
    length: int  # asked: the prompt has at most this many tokens
    seed: int
    index: int
    prompt: str  # RULER's template and answer prefix, no chat template
    answers: tuple[str, ...]  # every one must appear in the prediction (string_match_all)
    depths: tuple[float, ...]  # where each needle went, as a fraction of the haystack's units (niah, vt); () else
    needles: tuple[str, ...]  # the inserted needle texts, in the order of `depths`
    metric: str
    max_new_tokens: int
    tokens: int  # the prompt's token count (len(tokenizer(prompt).input_ids))
    units: int  # haystack units chosen by the search
    question_at: int  # where the question begins in `prompt` (characters): what follows the haystack


def task(name: str) -> Task:
    """The task called `name`; a ValueError naming the closest valid name otherwise."""
    if name in TASKS:
        return TASKS[name]
    close = difflib.get_close_matches(name, list(TASKS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown task {name!r}{hint} (tasks: {', '.join(TASKS)})")


def count_tokens(tokenizer, text: str) -> int:
    """Tokens the model is fed for `text`: the tokenizer's ids with its special tokens (no chat template)."""
    return len(tokenizer(text)["input_ids"])


def make_samples(name: str, tokenizer, length: int, count: int, seed: int = 0,
                 depths: Sequence[float] | None = None, words: WordLists | None = None) -> list[Sample]:
    """`count` samples of task `name` at `length` tokens (indices 0..count-1)."""
    return [make_sample(name, tokenizer, length, seed, i, depths, words) for i in range(count)]


def make_sample(name: str, tokenizer, length: int, seed: int = 0, index: int = 0,
                depths: Sequence[float] | None = None, words: WordLists | None = None) -> Sample:
    """Sample `index` of task `name` at `length` tokens, deterministic from (name, length, seed, index).

    `depths` (fractions in [0, 1], one per needle) place niah's needles; None draws them from RULER's 40 depths.
    `words` replaces the wonderwords lists (tests); None fetches them once (`words.word_lists`).
    """
    spec = task(name)
    if length < 1:
        raise ValueError(f"length must be a positive token count (got {length})")
    if depths is not None:
        if spec.family != "niah":
            raise ValueError(f"depths place needles of niah tasks; {name} is a {spec.family} task")
        wanted = spec.args["keys"] * spec.args["values"]
        if len(depths) != wanted or not all(0 <= d <= 1 for d in depths):
            raise ValueError(f"{name} has {wanted} needle(s): depths must be {wanted} fraction(s) in [0, 1] "
                             f"(got {list(depths)})")
    lists = words if words is not None or spec.family in ("vt", "fwe") else word_lists()
    build = _BUILDERS[spec.family]

    def at(units: int) -> _Built:
        rng = random.Random(f"ruler:{name}:{length}:{seed}:{index}")
        return build(spec, units, rng, length, lists, depths)

    units, built, tokens = _fit(at, tokenizer, length, name, _MIN_UNITS.get(spec.family, 1), _max_units(spec, lists))
    return Sample(name, length, seed, index, built.prompt, tuple(built.answers), tuple(built.depths),
                  tuple(built.needles), spec.metric, spec.max_new_tokens, tokens, units, built.question_at)


@dataclass
class _Built:
    prompt: str
    answers: list[str]
    depths: list[float] = field(default_factory=list)
    needles: list[str] = field(default_factory=list)
    question_at: int = 0


def _after(prompt: str, context: str) -> int:
    """Where the text after the (last) haystack begins in `prompt`: the question and answer prefix."""
    return prompt.rindex(context) + len(context)


def _fit(at: Callable[[int], _Built], tokenizer, length: int, name: str, low: int, high_cap: int | None
         ) -> tuple[int, _Built, int]:
    """The largest unit count whose prompt has at most `length` tokens (binary search, as RULER), its prompt and
    token count. The upper bound starts at 3× the estimate from a small prompt and doubles while it still fits."""
    floor, probe = low, low + 5
    base = count_tokens(tokenizer, at(low).prompt)
    per_unit = max((count_tokens(tokenizer, at(probe).prompt) - base) / (probe - low), 0.5)
    high = max(int(3 * length / per_unit), 2 * probe)
    if high_cap is not None:
        high = min(high, high_cap)
    while count_tokens(tokenizer, at(high).prompt) <= length and (high_cap is None or high < high_cap):
        low, high = high, 2 * high if high_cap is None else min(2 * high, high_cap)  # the estimate was short: widen
    best: tuple[int, _Built, int] | None = None
    lo, hi = low, high
    while lo <= hi:
        mid = (lo + hi) // 2
        built = at(mid)
        tokens = count_tokens(tokenizer, built.prompt)
        if tokens <= length:
            best, lo = (mid, built, tokens), mid + 1
        else:
            hi = mid - 1
    if best is None:
        need = count_tokens(tokenizer, at(floor).prompt)
        raise ValueError(f"length {length} is too short for {name}: its smallest prompt takes {need} tokens")
    return best


# -- needle in a haystack -------------------------------------------------------------------------------------------

_essay_words: list[str] = []


def _essay() -> list[str]:
    """The essay haystack: runner's pinned pydoc text as words (RULER: Paul Graham's essays)."""
    if not _essay_words:
        _essay_words.extend(re.sub(r"\s+", " ", load_text("pydoc").text).strip().split(" "))
    return _essay_words


def _draw(kind: str, rng: random.Random, words: WordLists | None) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    assert words is not None
    # RULER draws from sorted(set(adj-noun for every pair)); drawing each half uniformly is the same up to duplicates
    return f"{rng.choice(words.adjectives)}-{rng.choice(words.nouns)}"


def _sentences(text: str) -> list[str]:
    """Split at sentence ends (RULER uses nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _insert(units: list[str], needles: list[str], depths: list[float], by_chars: bool = False) -> list[float]:
    """Insert each needle before unit int(len × depth) (in depth order), or, `by_chars`, at the unit boundary
    nearest to that fraction of the units' characters (essay sentences differ in length); → the realised depths."""
    n = len(units)
    ends = list(itertools.accumulate(len(u) + 1 for u in units))  # characters up to the end of each unit
    total = ends[-1] if ends else 0
    order = sorted(range(len(needles)), key=lambda i: depths[i])
    realised = [0.0] * len(needles)
    places = []
    for i in order:
        if by_chars and total:
            want = depths[i] * total
            position = min(range(n + 1), key=lambda k: abs((ends[k - 1] if k else 0) - want))
            realised[i] = (ends[position - 1] if position else 0) / total
        else:
            position = min(int(n * depths[i]), n)
            realised[i] = position / n if n else 0.0
        places.append((position, i))
    for shift, (position, i) in enumerate(places):
        units.insert(position + shift, needles[i])
    return realised


def _build_niah(spec: Task, units: int, rng: random.Random, length: int, words: WordLists | None,
                depths: Sequence[float] | None) -> _Built:
    a = spec.args
    keys, values, needles = [], [], []
    for _ in range(a["keys"]):
        keys.append(_draw(a["key"], rng, words))
        values.append([_draw(a["value"], rng, words) for _ in range(a["values"])])
        needles += [NEEDLE.format(type_needle_v=a["value"], key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    where = list(depths) if depths is not None else [d / 100 for d in sorted(rng.sample(DEPTHS, len(needles)))]
    chosen = rng.sample(range(a["keys"]), a["queries"])
    queries = [keys[i] for i in chosen]
    answers = [x for i in chosen for x in values[i]]
    if a["haystack"] == "essay":
        essay = _essay()
        text = " ".join((essay * (units // len(essay) + 1))[:units])
        parts = _sentences(text)
        realised = _insert(parts, needles, where, by_chars=True)
        context = " ".join(parts)
    else:
        if a["haystack"] == "noise":
            parts = [NOISE] * units
        else:  # "needle": distractor needles with other keys and values
            parts = [NEEDLE.format(type_needle_v=a["value"], key=_draw(a["key"], rng, words),
                                   value=_draw(a["value"], rng, words)) for _ in range(units)]
        realised = _insert(parts, needles, where)
        context = "\n".join(parts)
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = NIAH_TEMPLATE + NIAH_PREFIX, a["value"]
    if a["queries"] * a["values"] == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        kind = kind[:-1]
    prompt = template.format(type_needle_v=kind, context=context, query=query)
    return _Built(prompt, answers, realised, needles, _after(prompt, context))


# -- variable tracking ----------------------------------------------------------------------------------------------

def _chains(rng: random.Random, chains: int, hops: int, letters: int) -> tuple[list[list[str]], list[list[str]]]:
    names = ["".join(rng.choices(string.ascii_uppercase, k=letters)) for _ in range((hops + 1) * chains)]
    while len(set(names)) < len(names):
        names = list(dict.fromkeys(names))
        names.append("".join(rng.choices(string.ascii_uppercase, k=letters)))
    out_vars, out_chains = [], []
    for c in range(chains):
        these = names[c * (hops + 1):(c + 1) * (hops + 1)]
        chain = [f"VAR {these[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)]
        out_vars.append(these)
        out_chains.append(chain)
    return out_vars, out_chains


def _vt_text(rng: random.Random, units: int, chains: int, hops: int, letters: int
             ) -> tuple[str, list[str], list[float], list[str]]:
    """RULER's noise-haystack variable tracking: (prompt with answer prefix, answers, depths, chain 0's lines)."""
    names, lines = _chains(rng, chains, hops, letters)
    value = lines[0][0].split("=")[-1].strip()
    parts = [NOISE] * units
    depths: list[float] = []
    for c, chain in enumerate(lines):
        positions = sorted(rng.sample(range(len(parts)), len(chain))) if parts else [0] * len(chain)
        for j, (position, line) in enumerate(zip(positions, chain)):
            parts.insert(position + j, line)
            if c == 0:
                depths.append(position / units if units else 0.0)
    context = "\n".join(parts).replace(". \n", ".\n")
    prompt = (VT_TEMPLATE + VT_PREFIX).format(context=context, query=value, num_v=hops + 1)
    return prompt, names[0], depths, lines[0]


def _build_vt(spec: Task, units: int, rng: random.Random, length: int, words: WordLists | None,
              depths: Sequence[float] | None) -> _Built:
    chains, hops = spec.args["chains"], spec.args["hops"]
    example, example_answers, _, _ = _vt_text(rng, VT_ICL_NOISE, chains, hops, 3)  # RULER's one worked example
    prompt, answers, realised, lines = _vt_text(rng, units, chains, hops, 5)
    shot = example + " " + " ".join(example_answers) + "\n"
    full = shot + "\n" + prompt
    return _Built(full, answers, realised, [line.strip() for line in lines], full.rindex("\nQuestion:"))


# -- common words extraction ----------------------------------------------------------------------------------------

_pools: dict[int, list[str]] = {}


def _pool(words: WordLists) -> list[str]:
    if id(words) not in _pools:
        _pools[id(words)] = sorted(set(words.nouns + words.adjectives + words.verbs))
    return _pools[id(words)]


def _cwe_example(rng: random.Random, pool: list[str], count: int, common: int, uncommon: int, num_cw: int
                 ) -> tuple[str, list[str]]:
    chosen = rng.sample(pool, count)
    top, rest = chosen[:num_cw], chosen[num_cw:]
    listed = top * common + rest * uncommon
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


def _build_cwe(spec: Task, units: int, rng: random.Random, length: int, words: WordLists | None,
               depths: Sequence[float] | None) -> _Built:
    assert words is not None
    a, pool = spec.args, _pool(words)
    short = length < 4096  # RULER: fewer repeats below 4k tokens
    shot_ctx, shot_top = _cwe_example(rng, pool, 20 if short else 40, 3 if short else 10, 1 if short else 3,
                                      a["num_cw"])
    ctx, top = _cwe_example(rng, pool, units, 6 if short else a["freq_cw"], 1 if short else a["freq_ucw"],
                            a["num_cw"])
    template = CWE_TEMPLATE + CWE_PREFIX
    shot = template.format(context=shot_ctx) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_top))
    full = shot + "\n" + template.format(context=ctx)
    return _Built(full, top, question_at=_after(full, ctx))


# -- frequent words extraction --------------------------------------------------------------------------------------

def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann ζ(alpha) for alpha > 1: a partial sum and the Euler–Maclaurin tail (scipy.special.zeta to ~1e-12)."""
    partial = math.fsum(k ** -alpha for k in range(1, terms))
    return partial + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha + alpha * terms ** (-alpha - 1) / 12


def _build_fwe(spec: Task, units: int, rng: random.Random, length: int, words: WordLists | None,
               depths: Sequence[float] | None) -> _Built:
    alpha, size = spec.args["alpha"], max((length - spec.max_new_tokens) // 50, 4)  # RULER's vocab size
    letters = spec.args["coded_wordlen"]
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=letters)) for _ in range(size)]
    while len(set(vocab)) < size:
        vocab = list(dict.fromkeys(vocab))
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=letters)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent one is noise
    z = zeta(alpha)
    listed = [w for k, w in enumerate(vocab, start=1) for _ in range(int(units * k ** -alpha / z))]
    rng.shuffle(listed)
    context = " ".join(listed)
    prompt = (FWE_TEMPLATE + FWE_PREFIX).format(context=context)
    return _Built(prompt, vocab[1:4], question_at=_after(prompt, context))


_BUILDERS = {"niah": _build_niah, "vt": _build_vt, "cwe": _build_cwe, "fwe": _build_fwe}
_MIN_UNITS = {"vt": 5, "cwe": 11, "fwe": 27}  # cwe needs more words than its 10 common ones; fwe its top four listed


def _max_units(spec: Task, words: WordLists | None) -> int | None:
    """cwe samples distinct words from wonderwords' lists (RULER falls back to another list beyond them)."""
    return len(_pool(words)) if spec.family == "cwe" and words is not None else None
