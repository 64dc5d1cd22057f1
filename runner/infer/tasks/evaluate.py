"""Run task samples through a model on a cache kind: predictions, scores with intervals, bytes and seconds.

Owns: one sample's greedy answer through the forward chain (`DecodeState.prefill` in chunks of `q_chunk` tokens,
except for an evicting kind, whose prompt goes in one forward since eviction acts on each prompt forward, or with
`compress="context"` only the haystack does, the question then fed a token at a time, stored as it comes; then
`feed` one token at a time on a cache from `make_cache(kind, model)`, so any kind string `make_cache` accepts
works, eviction options included), the stop rules, the cache's measured bytes after the prefill, prefill and decode
seconds through the timing harness's `Stopwatch`, and the per-task scores (`scoring.TaskScore`). Batch 1.
Several kinds at once (`answer_kinds`, `evaluate_kinds`): the evicting ones share one prompt forward a sample.
Stops: the model's EOS; the task's max answer tokens (RULER's tokens_to_generate); the model's context; for a task
of one reference, a line break after a line that could hold it (`stop_at_newline`, `ends_an_answer_line`; RULER
has no stop words); every reference already in the answer (more text cannot lower a substring score, so stopping
there changes no score and saves decoding).
Does not know about manifests; a length above the model's context or an unknown task is a ValueError.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from runner.infer.cache.evicting import EvictingMixin
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.config.kinds import parse_kind
from runner.infer.config.tasks import length_problem
from runner.infer.decode.forward import DecodeState, eos_ids, trim_mask
from runner.infer.decode.sampling import greedy_tokens
from runner.infer.measure.timing import Stopwatch, on_device
from runner.infer.tasks.ruler import Sample, make_samples, task
from runner.infer.tasks.scoring import TaskScore, postprocess, score
from runner.report import ProgressFactory, no_progress

log = logging.getLogger(__name__)

COMPRESSES = ("prompt", "context")  # what an evicting kind presses: the whole prompt, or the haystack alone


@dataclass(frozen=True)
class SampleResult:
    """What one sample gave: the prediction, its score in [0, 1], tokens, seconds and the cache's bytes."""

    sample: Sample
    prediction: str
    score: float
    prompt_tokens: int
    new_tokens: int
    stop: str  # eos | max_tokens | context | newline | answered
    prefill_s: float
    decode_s: float
    cache_bytes: int  # measured after the prefill

    def record(self) -> dict:
        """Everything but the sample, which `make_samples` makes again from its task, length, index and seed."""
        return {name: getattr(self, name) for name in RECORDED}

    @classmethod
    def of(cls, sample: Sample, record: dict) -> SampleResult:
        """The result `record` (a `record()`) holds for `sample`."""
        return cls(sample, **{name: record[name] for name in RECORDED})


RECORDED = ("prediction", "score", "prompt_tokens", "new_tokens", "stop", "prefill_s", "decode_s", "cache_bytes")
SampleKey = tuple[str, int, int]  # (task, length, index): a sample, given the seed


def sample_key(sample: Sample) -> SampleKey:
    return sample.task, sample.length, sample.index


@dataclass(frozen=True)
class Evaluation:
    """Every sample's result and the per-(task, length) scores, for one cache kind."""

    cache_kind: str | None
    results: list[SampleResult]
    scores: dict[tuple[str, int], TaskScore] = field(default_factory=dict)

    @property
    def prefill_s(self) -> float:
        return sum(r.prefill_s for r in self.results)

    @property
    def decode_s(self) -> float:
        return sum(r.decode_s for r in self.results)

    def rows(self) -> list[dict]:
        """One plain row per (task, length): score, interval, n, mean seconds and bytes per sample."""
        out = []
        for (name, length), s in self.scores.items():
            mine = [r for r in self.results if r.sample.task == name and r.sample.length == length]
            out.append({"task": name, "length": length, "cache_kind": self.cache_kind, "score": s.score,
                        "low": s.interval.low, "high": s.interval.high, "interval": s.interval.method, "n": s.n,
                        "informative": s.informative,
                        "prefill_s": sum(r.prefill_s for r in mine) / len(mine),
                        "decode_s": sum(r.decode_s for r in mine) / len(mine),
                        "cache_bytes": max(r.cache_bytes for r in mine)})
        return out


def context_limit(model) -> int | None:
    """The model's context in tokens (max_position_embeddings of its text config), None when it has none."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None


def check_length(model, length: int, tasks: Sequence[str]) -> None:
    """A ValueError when prompts of `length` tokens leave no room in the model's context (max_position_embeddings)
    for the answers of `tasks`."""
    if problem := length_problem(length, list(tasks), context_limit(model)):
        raise ValueError(problem)


def evaluate_tasks(model, tokenizer, tasks: Sequence[str], lengths: Sequence[int], count: int, seed: int = 0,
                   cache_kinds: Sequence[str | None] = (None,), *, q_chunk: int | None = 512,
                   stop_at_newline: bool = True, compress: str = "prompt",
                   progress: ProgressFactory = no_progress) -> list[Evaluation]:
    """`count` samples of every task at every length (checked before any is made), evaluated on each of
    `cache_kinds` (evaluate_kinds)."""
    for name in tasks:
        task(name)
    for length in lengths:
        check_length(model, length, tasks)
    samples = [s for name in tasks for length in lengths for s in make_samples(name, tokenizer, length, count, seed)]
    return evaluate_kinds(model, tokenizer, samples, cache_kinds, q_chunk=q_chunk, stop_at_newline=stop_at_newline,
                          compress=compress, progress=progress)


def evaluate(model, tokenizer, samples: Sequence[Sample], cache_kind: str | None = None, *,
             q_chunk: int | None = 512, stop_at_newline: bool = True, compress: str = "prompt",
             progress: ProgressFactory = no_progress) -> Evaluation:
    """Greedy answers to `samples` on a fresh cache of `cache_kind` each (None = the model's dtype), scored."""
    return evaluate_kinds(model, tokenizer, samples, [cache_kind], q_chunk=q_chunk, stop_at_newline=stop_at_newline,
                          compress=compress, progress=progress)[0]


def evaluate_kinds(model, tokenizer, samples: Sequence[Sample], cache_kinds: Sequence[str | None], *,
                   q_chunk: int | None = 512, stop_at_newline: bool = True, compress: str = "prompt",
                   progress: ProgressFactory = no_progress,
                   answered: Mapping[SampleKey, Sequence[SampleResult]] | None = None,
                   on_answer: Callable[[Sample, list[SampleResult]], None] | None = None) -> list[Evaluation]:
    """`evaluate` on each of `cache_kinds`, sample by sample, the evicting kinds sharing one prompt forward a
    sample (`answer_kinds`): N evicting candidates cost one prefill and N decodes, not N prefills. A sample in
    `answered` (one result per kind, from an interrupted run's journal) is taken as it is; `on_answer` gets each
    sample answered here as soon as it is, to journal it."""
    if not cache_kinds:
        return []
    for sample in samples:
        check_length(model, sample.length, [sample.task])
    named = ", ".join(kind or "the uncompressed cache" for kind in cache_kinds)
    bar = progress(f"tasks on {named}", len(samples), "sample")
    results: list[list[SampleResult]] = [[] for _ in cache_kinds]
    answered = answered or {}
    try:
        for sample in samples:
            given = answered.get(sample_key(sample))
            if given is None:
                given = answer_kinds(model, tokenizer, sample, cache_kinds, q_chunk=q_chunk,
                                     stop_at_newline=stop_at_newline, compress=compress)
                if on_answer is not None:
                    on_answer(sample, given)
            for mine, result in zip(results, given, strict=True):
                mine.append(result)
            scores = " ".join(f"{mine[-1].score:.2f}" for mine in results)
            bar.update(1, f"{sample.task}@{sample.length}: {scores}")
    finally:
        bar.close()
    return [_scored(kind, mine) for kind, mine in zip(cache_kinds, results)]


def _scored(cache_kind: str | None, results: list[SampleResult]) -> Evaluation:
    groups: dict[tuple[str, int], list[float]] = {}
    for r in results:
        groups.setdefault((r.sample.task, r.sample.length), []).append(r.score)
    scores = {key: TaskScore.of(key[0], key[1], values) for key, values in groups.items()}
    for s in scores.values():
        log.info("%s at %d on %s: %.1f [%.1f, %.1f] over %d samples", s.task, s.length, cache_kind or "uncompressed",
                 s.score, s.interval.low, s.interval.high, s.n)
    return Evaluation(cache_kind, results, scores)


@torch.inference_mode()
def answer(model, tokenizer, sample: Sample, cache_kind: str | None = None, *, q_chunk: int | None = 512,
           stop_at_newline: bool = True, compress: str = "prompt") -> SampleResult:
    """One sample's greedy answer on a fresh cache of `cache_kind`, scored by the sample's metric. `compress`
    (COMPRESSES): what an evicting kind presses, the whole prompt in one forward or the haystack alone."""
    prompt = _Prompt.of(model, tokenizer, sample, cache_kind, compress)
    state = DecodeState(make_cache(cache_kind, model))
    watch = Stopwatch(**on_device(prompt.ids.device))
    logits, _ = state.prefill(model, prompt.pressed, torch.ones_like(prompt.pressed),
                              None if prompt.evicting else q_chunk)
    return _finish(model, tokenizer, prompt, state, logits, watch, watch.lap(), stop_at_newline)


@torch.inference_mode()
def answer_kinds(model, tokenizer, sample: Sample, cache_kinds: Sequence[str | None], *, q_chunk: int | None = 512,
                 stop_at_newline: bool = True, compress: str = "prompt") -> list[SampleResult]:
    """`answer` on each of `cache_kinds`, the evicting kinds sharing one prompt forward (same results, faster).

    Why this is exact: a layer that presses a forward on an empty cache (EvictingMixin) gives that forward's
    attention the forward's own float K/V whatever its kind stores, so every layer's input, and the last logits,
    are the same for every evicting kind; only what each layer keeps and stores differs. So the first evicting
    kind's forward hands each layer's `update` call (its eviction inputs with it) to the same layer of every other
    evicting kind's cache as it happens (`_tee`: nothing is kept beyond the caches). A kind whose layers did not
    all press (a ratio that keeps the whole prompt, a layer without eviction) is answered again on its own, through
    `answer`; every kind is if the first one did not press; so is every kind without eviction. Prefill seconds of
    a shared forward: the forward's, every kind's store included, for each."""
    results: dict[int, SampleResult] = {}
    shared = [i for i, kind in enumerate(cache_kinds) if evicting(kind)]
    for i, kind in enumerate(cache_kinds):
        if i not in shared or len(shared) == 1:
            results[i] = answer(model, tokenizer, sample, kind, q_chunk=q_chunk, stop_at_newline=stop_at_newline,
                                compress=compress)
    if len(shared) > 1:
        prompt = _Prompt.of(model, tokenizer, sample, cache_kinds[shared[0]], compress)
        caches = [make_cache(cache_kinds[i], model) for i in shared]
        watch = Stopwatch(**on_device(prompt.ids.device))
        first = DecodeState(caches[0])
        with _tee(caches[0], caches[1:]):
            logits, _ = first.prefill(model, prompt.pressed, torch.ones_like(prompt.pressed), None)
        forward_s = watch.lap()
        columns, led = prompt.pressed.shape[1], _pressed(caches[0])
        for n, (i, cache) in enumerate(zip(shared, caches)):
            if not (led and _pressed(cache)):  # its own forward would not be this one
                results[i] = answer(model, tokenizer, sample, cache_kinds[i], stop_at_newline=stop_at_newline,
                                    compress=compress)
                continue
            state = first if n == 0 else DecodeState(  # what prefill leaves (batch 1, no padding)
                cache, mask=trim_mask(torch.ones_like(prompt.pressed), cache),
                seen=torch.tensor([columns], device=prompt.ids.device), length=columns)
            watch.lap()
            results[i] = _finish(model, tokenizer, prompt, state, logits, watch, forward_s, stop_at_newline)
            caches[n] = None  # type: ignore[call-overload]  # answered: its memory can go
    return [results[i] for i in range(len(cache_kinds))]


def evicting(kind: str | None) -> bool:
    """Whether `kind` evicts (its options after a '+')."""
    options = parse_kind(kind)
    return options is not None and options.eviction is not None


@contextmanager
def _tee(cache, others: list) -> Iterator[None]:
    """Within: each layer's `update` of `cache` also makes the same call, eviction inputs first, on the same layer
    of every cache in `others`."""
    for i, layer in enumerate(cache.layers):
        followers = [other.layers[i] for other in others]

        def update(key_states, value_states, *args, _layer=layer, _update=layer.update, _followers=followers,
                   **kwargs):
            for follower in _followers:
                follower.evict_inputs = _layer.evict_inputs
                follower.update(key_states, value_states, *args, **kwargs)
            return _update(key_states, value_states, *args, **kwargs)
        layer.update = update
    try:
        yield
    finally:
        for layer in cache.layers:
            del layer.update  # the instance's wrapper: the class's method again


def _pressed(cache) -> bool:
    """Whether every layer evicted from its one prompt forward (and so returned the forward's own K/V)."""
    return all(isinstance(layer, EvictingMixin) and layer.kept_index is not None for layer in cache.layers)


@dataclass(frozen=True)
class _Prompt:
    """A sample's prompt ids, split into what is pressed in one forward and the question fed after it."""

    sample: Sample
    ids: torch.Tensor  # [1,T]
    pressed: torch.Tensor  # [1,c]: the whole prompt, or the haystack with compress="context" on an evicting kind
    question: torch.Tensor  # [1,T−c]
    room: int  # answer tokens allowed: the task's cap within the model's context
    evicting: bool

    @classmethod
    def of(cls, model, tokenizer, sample: Sample, cache_kind: str | None, compress: str) -> _Prompt:
        if compress not in COMPRESSES:
            raise ValueError(f"compress must be one of {', '.join(COMPRESSES)} (got {compress!r})")
        device = next(model.parameters()).device
        ids = torch.tensor([tokenizer(sample.prompt)["input_ids"]], device=device)
        if ids.shape[1] != sample.tokens:  # a sample made with another tokenizer
            log.warning("%s sample %d has %d tokens with this tokenizer (made with %d)", sample.task, sample.index,
                        ids.shape[1], sample.tokens)
        limit = context_limit(model)
        room = sample.max_new_tokens if limit is None else max(0, min(sample.max_new_tokens, limit - ids.shape[1]))
        presses = evicting(cache_kind)
        cut = question_start(tokenizer, sample) if presses and compress == "context" else ids.shape[1]
        return cls(sample, ids, ids[:, :cut], ids[:, cut:], room, presses)


def _finish(model, tokenizer, prompt: _Prompt, state: DecodeState, logits: torch.Tensor, watch: Stopwatch,
            pressed_s: float, stop_at_newline: bool) -> SampleResult:
    """From the pressed prompt's last logits: feed the question (one token a step: stored as it comes, never
    pressed, kvpress's question), measure the cache, decode greedily to a stop, score."""
    sample, eos, live = prompt.sample, eos_ids(model), torch.ones(1, dtype=torch.long, device=prompt.ids.device)
    for column in prompt.question[0]:
        logits = state.feed(model, column[None], live)
    token = greedy_tokens(logits)
    prefill_s = pressed_s + watch.lap()
    nbytes = cache_bytes(state.cache)
    watch.lap()  # the bytes are not decode time
    new: list[int] = []
    text, stop = "", "max_tokens" if prompt.room == sample.max_new_tokens else "context"
    while len(new) < prompt.room:
        if int(token) in eos:
            stop = "eos"
            break
        new.append(int(token))
        text = tokenizer.decode(new, skip_special_tokens=True)
        if all(r.lower() in text.lower() for r in sample.answers):
            stop = "answered"
            break
        if stop_at_newline and ends_an_answer_line(text, sample):
            stop = "newline"
            break
        if len(new) == prompt.room:
            break
        token = greedy_tokens(state.feed(model, token, live))
    decode_s = watch.lap()
    prediction = postprocess(text)
    return SampleResult(sample, prediction, score(sample.metric, prediction, sample.answers), prompt.ids.shape[1],
                        len(new), stop, prefill_s, decode_s, nbytes)


def ends_an_answer_line(text: str, sample: Sample) -> bool:
    """Whether decoding may stop at a line break in `text`: only for a task of one reference, and only after a line
    that could hold it, one with a word character that does not end in ":" (": " or "The number is:" then a break
    introduce the answer). A list of references (niah_multivalue, multiquery, vt, cwe, fwe) goes on across lines,
    as RULER generates it: a break there would cut the list after its first line."""
    *lines, _ = text.split("\n")
    return len(sample.answers) == 1 and any(re.search(r"\w", line) and not line.rstrip().endswith(":")
                                            for line in lines)


def question_start(tokenizer, sample: Sample) -> int:
    """How many of the prompt's tokens hold the haystack and what precedes it: the first token that starts at or
    after the question (`Sample.question_at`) begins the rest. Cut in the prompt's own tokens, so both parts
    together are exactly what `compress="prompt"` feeds."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    return next((i for i, (start, end) in enumerate(spans) if start >= sample.question_at and end > start),
                len(spans))


__all__ = ["COMPRESSES", "Evaluation", "SampleResult", "answer", "answer_kinds", "check_length", "context_limit",
           "evaluate", "evaluate_kinds", "evaluate_tasks", "evicting", "question_start"]
