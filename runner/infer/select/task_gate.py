"""The task gate of cache selection (`cache_quality_tasks`): a candidate cache must not lose long-context task
accuracy against the reference cache, beyond the noise of the sample count.

    TaskGate(model, tokenizer, gates)   the reference's scores, once: every task × length, `samples` each, seeded
    gate.judge(model, rows)             the same samples on each row's kind → each row's task figures and failures
                                        (the evicting kinds share one prompt forward a sample: tasks.evaluate_kinds)

Per (task, length) the drop is how far the candidate's score falls below the reference's 95 % interval
(`tasks.scoring.drop_beyond_noise`: a drop within the interval is not a drop); pairs the reference cannot do
(`TaskScore.informative`) do not gate and are counted in the row. The gate compares the mean drop over the
informative pairs with `max_drop`, or each pair's with `per_task`. Run after the ΔNLL/KL gates, on their survivors
only: a prefill of thousands of tokens per sample is the selection's most expensive measurement.
"""

from __future__ import annotations

import statistics

from runner.infer.config.tasks import TaskGates
from runner.infer.tasks.evaluate import Evaluation, evaluate_tasks
from runner.infer.tasks.scoring import TaskScore, drop_beyond_noise
from runner.report import ProgressFactory, no_progress


class TaskGate:
    """The reference cache's task scores and the rule that judges a candidate's against them."""

    def __init__(self, model, tokenizer, gates: TaskGates, progress: ProgressFactory = no_progress):
        self.gates, self.tokenizer, self.progress = gates, tokenizer, progress
        self.reference = self._evaluate(model, [None])[0]

    def _evaluate(self, model, kinds: list[str | None]) -> list[Evaluation]:
        g = self.gates
        return evaluate_tasks(model, self.tokenizer, g.tasks, g.lengths, g.samples, g.seed, kinds,
                              compress=g.compress, progress=self.progress)

    def judge(self, model, rows: list[dict]) -> list[list[str]]:
        """Score each row's kind on the reference's samples; put its figures in its row; → each row's failures,
        each with its figure."""
        if not rows:
            return []
        out: list[list[str]] = []
        for row, evaluation in zip(rows, self._evaluate(model, [row["kind"] for row in rows])):
            figures, failures = verdict(self.reference.scores, evaluation.scores, self.gates)
            row.update(figures)
            out.append(failures)
        return out


def verdict(reference: dict[tuple[str, int], TaskScore], candidate: dict[tuple[str, int], TaskScore],
            gates: TaskGates) -> tuple[dict, list[str]]:
    """(the row's task figures, the failures): the rule on (task, length) → scores of the same samples."""
    useful = [key for key, score in reference.items() if score.informative]
    drops = {key: drop_beyond_noise(reference[key], candidate[key]) for key in useful}
    figures = {"task_score": _mean(candidate[k].score for k in useful),
               "task_reference": _mean(reference[k].score for k in useful), "task_drop": _mean(drops.values()),
               "task_pairs": len(useful), "task_uninformative": len(reference) - len(useful),
               "task_samples": gates.samples}
    if not useful:
        return figures, []  # nothing the reference can do: no gate (task_pairs = 0 says so)
    if gates.per_task:
        return figures, [f"{name}@{length} drop {drop:.1f} > {gates.max_drop:g}"
                         for (name, length), drop in drops.items() if not drop <= gates.max_drop]
    drop = figures["task_drop"]
    return figures, [f"task drop {drop:.1f} > {gates.max_drop:g}"] if not drop <= gates.max_drop else []


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")
