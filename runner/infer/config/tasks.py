"""The long-context task suite's settings, without torch: which RULER-style tasks, at which prompt lengths, how many
samples, and the gate a cache candidate's task scores must pass.

Shared by `mode: eval` (the manifest's `eval` block) and `cache_kind: auto` / auto-cache-select (the
`cache_quality_tasks` key), so `run check` judges a task name, a length or a drop exactly as the library uses them.
The tasks themselves (prompts, answers, scoring) are runner.infer.tasks; docs/long-context.md says what each is.
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runner.errors import ValueAt

# RULER's synthetic tasks that need no downloaded dataset (its QA tasks need SQuAD / HotpotQA: left out).
TASK_NAMES = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
ANSWER_TOKENS = {name: 128 for name in TASK_NAMES if name.startswith("niah")} | {"vt": 30, "cwe": 120, "fwe": 50}
# RULER's tokens_to_generate per task: a prompt of `length` tokens needs this much more room in the model's context
MAX_LENGTH = 1_000_000  # tokens: beyond every model's context; the model's own limit is checked where it is known


def length_problem(length: int, tasks: list[str], context: int | None) -> str:
    """Why prompts of `length` tokens leave no room in a context of `context` tokens for the answers of `tasks`;
    "" when they fit (or the context is not known)."""
    answer = max(ANSWER_TOKENS.get(name, 0) for name in tasks)
    if context is None or length + answer <= context:
        return ""
    return (f"length {length} leaves no room for the answers in the model's context of {context} tokens (prompt + up "
            f"to {answer} generated): use lengths up to {context - answer}")


def task_problem(name: str) -> str:
    """Why `name` is not a task of the suite, with the closest one; "" when it is."""
    if name in TASK_NAMES:
        return ""
    close = difflib.get_close_matches(name, TASK_NAMES, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown task {name!r}: {hint}the suite has {', '.join(TASK_NAMES)} (docs/long-context.md)"


class TaskSuite(BaseModel):
    """Which samples: every task at every length, `samples` of each, drawn from `seed` (the same seed, the same
    prompts, on any machine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: list[str] = Field(default_factory=lambda: ["niah_single_1", "niah_multikey_1", "vt", "cwe"], min_length=1,
                             description="Tasks of the suite (docs/long-context.md): niah_single_1..3, "
                                         "niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe.")
    lengths: list[int] = Field(default_factory=lambda: [1024], min_length=1, description=(
        "Prompt lengths in tokens: every task is built at each. Each, plus the longest answer a task may generate "
        "(RULER's tokens_to_generate: 128 for the niah tasks), must fit the model's context."))
    samples: int = Field(5, ge=1, le=10_000, description=(
        "Samples per task and length. Every score is reported with its count and a 95 % interval: few samples, "
        "wide intervals."))
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the samples (needles, keys, words, depths).")
    compress: Literal["prompt", "context"] = Field("prompt", description=(
        "What a cache kind with eviction presses: the whole prompt in one forward, question included (its "
        "queries score the haystack), or the haystack alone, the question then fed after it and kept whole "
        "(kvpress's pipeline, RULER as kvpress reports it). Kinds without eviction feed the same either way."))

    @model_validator(mode="after")
    def _known_tasks_and_lengths(self):
        """Each bad item reported at itself (tasks[1], lengths[0])."""
        for i, name in enumerate(self.tasks):
            if problem := task_problem(name):
                raise ValueAt(("tasks", i), problem)
            if name in self.tasks[:i]:
                raise ValueAt(("tasks", i), f"task {name!r} is listed twice")
        for i, length in enumerate(self.lengths):
            if not 128 <= length <= MAX_LENGTH:
                raise ValueAt(("lengths", i), f"length {length} is outside 128..{MAX_LENGTH:,} tokens: a task needs "
                              "room for its instructions, needles and question")
            if length in self.lengths[:i]:
                raise ValueAt(("lengths", i), f"length {length} is listed twice")
        return self


class TaskGates(TaskSuite):
    """The task gate of cache selection: a candidate fails when its score drops more than `max_drop` points (of 100)
    below the reference cache's, beyond the reference's 95 % interval (a drop within it is noise, not a drop).
    Tasks the reference itself cannot do at a length (not informative) do not gate."""

    max_drop: float = Field(2.0, ge=0, le=100, description=(
        "Most drop in task score, points of 100, against the reference cache (averaged over tasks and lengths, or "
        "each with per_task)."))
    per_task: bool = Field(False, description="Gate each task and length on its own instead of their average.")
