"""Run task samples through a model on a cache kind: predictions, scores with intervals, bytes and seconds.

Owns: one sample's greedy answer through the forward chain (`DecodeState.prefill` in chunks of `q_chunk` tokens,
except for an evicting kind, whose prompt goes in one forward since eviction acts on each prompt forward, or with
`compress="context"` only the haystack does, the question then fed a token at a time, stored as it comes; then
`feed` one token at a time on a cache from `make_cache(kind, model)`, so any kind string `make_cache` accepts
works, eviction options included), the stop rules, the cache's measured bytes after the prefill, prefill and decode
seconds through the timing harness's `Stopwatch`, and the per-task scores (`scoring.TaskScore`). Batch 1.
Stops: the model's EOS; the task's max answer tokens (RULER's tokens_to_generate); the model's context; a line break
after some answer text (`stop_at_newline`, RULER has no stop words); every reference already in the answer (more
text cannot lower a substring score, so stopping there changes no score and saves decoding).
Does not know about manifests; a length above the model's context or an unknown task is a ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.config.kinds import parse_kind
from runner.infer.decode.forward import DecodeState, eos_ids
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


def check_length(model, length: int) -> None:
    """A ValueError when `length` tokens exceed the model's context."""
    limit = context_limit(model)
    if limit is not None and length > limit:
        raise ValueError(f"length {length} is above the model's context ({limit} tokens, max_position_embeddings); "
                         f"use a length of at most {limit}")


def evaluate_tasks(model, tokenizer, tasks: Sequence[str], lengths: Sequence[int], count: int, seed: int = 0,
                   cache_kind: str | None = None, *, q_chunk: int | None = 512, stop_at_newline: bool = True,
                   compress: str = "prompt", progress: ProgressFactory = no_progress) -> Evaluation:
    """`count` samples of every task at every length (checked before any is made), evaluated on `cache_kind`."""
    for name in tasks:
        task(name)
    for length in lengths:
        check_length(model, length)
    samples = [s for name in tasks for length in lengths for s in make_samples(name, tokenizer, length, count, seed)]
    return evaluate(model, tokenizer, samples, cache_kind, q_chunk=q_chunk, stop_at_newline=stop_at_newline,
                    compress=compress, progress=progress)


def evaluate(model, tokenizer, samples: Sequence[Sample], cache_kind: str | None = None, *,
             q_chunk: int | None = 512, stop_at_newline: bool = True, compress: str = "prompt",
             progress: ProgressFactory = no_progress) -> Evaluation:
    """Greedy answers to `samples` on a fresh cache of `cache_kind` each (None = the model's dtype), scored."""
    for sample in samples:
        check_length(model, sample.length)
    bar = progress(f"tasks on {cache_kind or 'the uncompressed cache'}", len(samples), "sample")
    results = []
    try:
        for sample in samples:
            results.append(answer(model, tokenizer, sample, cache_kind, q_chunk=q_chunk,
                                  stop_at_newline=stop_at_newline, compress=compress))
            bar.update(1, f"{sample.task}@{sample.length}: {results[-1].score:.2f}")
    finally:
        bar.close()
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
    if compress not in COMPRESSES:
        raise ValueError(f"compress must be one of {', '.join(COMPRESSES)} (got {compress!r})")
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(sample.prompt)["input_ids"]], device=device)
    if ids.shape[1] != sample.tokens:  # a sample made with another tokenizer
        log.warning("%s sample %d has %d tokens with this tokenizer (made with %d)", sample.task, sample.index,
                    ids.shape[1], sample.tokens)
    limit = context_limit(model)
    room = sample.max_new_tokens if limit is None else max(0, min(sample.max_new_tokens, limit - ids.shape[1]))
    eos = eos_ids(model)
    state = DecodeState(make_cache(cache_kind, model))
    options = parse_kind(cache_kind)
    evicting = options is not None and options.eviction is not None
    if evicting:
        q_chunk = None  # eviction runs on each prompt forward: the whole prompt at once, as kvpress presses it
    pressed, question = ids, ids[:, ids.shape[1]:]
    if evicting and compress == "context":
        cut = question_start(tokenizer, sample)
        pressed, question = ids[:, :cut], ids[:, cut:]
    live = torch.ones(1, dtype=torch.long, device=device)
    watch = Stopwatch(**on_device(device))
    logits, _ = state.prefill(model, pressed, torch.ones_like(pressed), q_chunk)
    for column in question[0]:  # one token a step: stored as it comes, never pressed (kvpress's question)
        logits = state.feed(model, column[None], live)
    token = greedy_tokens(logits)
    prefill_s = watch.lap()
    nbytes = cache_bytes(state.cache)
    watch.lap()  # the bytes are not decode time
    new: list[int] = []
    text, stop = "", "max_tokens" if room == sample.max_new_tokens else "context"
    while len(new) < room:
        if int(token) in eos:
            stop = "eos"
            break
        new.append(int(token))
        text = tokenizer.decode(new, skip_special_tokens=True)
        if all(r.lower() in text.lower() for r in sample.answers):
            stop = "answered"
            break
        if stop_at_newline and "\n" in text.lstrip():
            stop = "newline"
            break
        if len(new) == room:
            break
        token = greedy_tokens(state.feed(model, token, live))
    decode_s = watch.lap()
    prediction = postprocess(text)
    return SampleResult(sample, prediction, score(sample.metric, prediction, sample.answers), ids.shape[1], len(new),
                        stop, prefill_s, decode_s, nbytes)


def question_start(tokenizer, sample: Sample) -> int:
    """How many of the prompt's tokens hold the haystack and what precedes it: the first token that starts at or
    after the question (`Sample.question_at`) begins the rest. Cut in the prompt's own tokens, so both parts
    together are exactly what `compress="prompt"` feeds."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    return next((i for i, (start, end) in enumerate(spans) if start >= sample.question_at and end > start),
                len(spans))


__all__ = ["COMPRESSES", "Evaluation", "SampleResult", "answer", "check_length", "context_limit", "evaluate",
           "evaluate_tasks", "question_start"]
