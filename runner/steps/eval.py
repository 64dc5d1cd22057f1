"""mode: eval: the long-context task suite (runner.infer.tasks) scored on the model's own uncompressed cache (the
reference) and on each cache kind of the block (quantized, evicting, or both), on the same seeded samples.

One table, task × length × cache kind: the score (points of 100), its sample count and 95 % interval, whether the
reference's score is informative (a task the model cannot do uncompressed gates nothing), the drop beyond the
reference's interval, the cache's measured MiB after the prompt and its ratio to the reference's, and seconds per
sample. The evicting kinds are evaluated together, sharing one prompt forward a sample (tasks.evaluate_kinds);
the others one at a time. Each sample's answers are journaled as they come (`eval_samples.jsonl`, with the step's
hash), so a step interrupted after hours of prefill, rerun with `--resume`, answers only what it had not; the tables
are written after each kind (the evicting ones: after all of them); the frontier (mean score against bytes) is
plotted.
"""

from __future__ import annotations

import logging
import re
import statistics
from functools import partial
from pathlib import Path

import pandas as pd

from runner.errors import StepError
from runner.files import append_json_line, read_json_lines
from runner.infer.loading.models import LoadedModel
from runner.infer.select.autocache import reference_kind
from runner.infer.tasks.evaluate import (
    Evaluation,
    SampleKey,
    SampleResult,
    check_length,
    evaluate_kinds,
    evicting,
    sample_key,
)
from runner.infer.tasks.ruler import Sample, make_samples
from runner.infer.tasks.scoring import drop_beyond_noise
from runner.manifest.eval_block import EvalBlock
from runner.manifest.plan import Step
from runner.report import ProgressFactory, show
from runner.steps.shared import markdown, step_block

log = logging.getLogger(__name__)
MIB = 2**20
JOURNAL = "eval_samples.jsonl"
COLUMNS = ["task", "length", "cache_kind", "score", "low", "high", "n", "reference_score", "informative", "drop",
           "cache_mib", "bytes_ratio", "prefill_s", "decode_s"]


def run_eval(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(EvalBlock, step)
    try:  # a length past the model's context, or too short for a task's smallest prompt with this tokenizer
        for length in block.lengths:
            check_length(lm.model, length, block.tasks)
        samples = [s for name in block.tasks for length in block.lengths
                   for s in make_samples(name, lm.tokenizer, length, block.samples, block.seed)]
    except ValueError as error:
        raise StepError(f"step {step.key}: eval.lengths: {error}") from None
    reference_name = reference_kind(lm.model)
    kinds = [None, *(k for k in block.cache_kinds if k != reference_name)]
    pressing = [k for k in kinds if evicting(k)]  # one group: they share a prompt forward a sample
    groups = [[k] for k in kinds if not evicting(k)] + ([pressing] if pressing else [])
    rows: list[dict] = []
    answers: list[dict] = []
    reference: Evaluation | None = None
    ref_bytes: dict = {}
    journal = Journal(out_dir / JOURNAL, step.hash, {sample_key(s): s for s in samples})
    for group in groups:
        names = [kind or reference_name for kind in group]
        for evaluation in evaluate_kinds(lm.model, lm.tokenizer, samples, group, q_chunk=block.prefill_chunk,
                                         compress=block.compress, progress=progress,
                                         answered=journal.answered(names), on_answer=partial(journal.add, names)):
            name = evaluation.cache_kind or reference_name
            if reference is None:  # the first kind (None): the uncompressed cache every other is judged against
                reference = evaluation
                ref_bytes = {(r["task"], r["length"]): r["cache_bytes"] for r in evaluation.rows()}
            for row in evaluation.rows():
                key = (row["task"], row["length"])
                base, mine = reference.scores[key], evaluation.scores[key]
                rows.append({**row, "cache_kind": name, "reference_score": base.score,
                             "informative": base.informative, "drop": drop_beyond_noise(base, mine),
                             "cache_mib": row["cache_bytes"] / MIB,
                             "bytes_ratio": row["cache_bytes"] / ref_bytes[key] if ref_bytes[key] else float("nan")})
            answers += [{"task": r.sample.task, "length": r.sample.length, "index": r.sample.index,
                         "cache_kind": name, "score": r.score, "prediction": r.prediction,
                         "answers": " | ".join(r.sample.answers), "stop": r.stop, "prompt_tokens": r.prompt_tokens,
                         "new_tokens": r.new_tokens} for r in evaluation.results]
            log.info("[%s] %s: mean score %.1f", step.key, name,
                     statistics.fmean(r.score for r in evaluation.results) * 100)
        order = {kind or reference_name: i for i, kind in enumerate(kinds)}  # the manifest's order, not the groups'
        rows.sort(key=lambda row: order[row["cache_kind"]])
        answers.sort(key=lambda row: order[row["cache_kind"]])
        _write(out_dir, rows, answers)  # after every group: an interrupt keeps what finished
    table = pd.DataFrame(rows)[COLUMNS]
    summary = _summary(table)
    _plot(summary, out_dir / "eval_frontier.png")
    show(f"\n[{step.key}] long-context tasks ({block.samples} samples each, seed {block.seed}; scores in points "
         f"with 95 % intervals; drop = below the reference's interval):\n{markdown(table)}\n\n"
         f"[{step.key}] per cache kind, over the tasks the reference can do (informative):\n{markdown(summary)}")
    return {"scores": table.astype(object).where(table.notna(), None).to_dict("records"),
            "summary": summary.astype(object).where(summary.notna(), None).to_dict("records"),
            "metrics": _metrics(summary), "params": {"eval.samples": len(samples), "eval.cache_kinds": len(kinds)}}


class Journal:
    """The samples a step answered, a JSON line each as it finished: {hash, kinds, task, length, index, results (a
    `SampleResult.record()` per kind)}. Lines of another hash (another manifest or code) are not this step's."""

    def __init__(self, path: Path, step_hash: str, samples: dict[SampleKey, Sample]):
        self.path, self.hash, self.samples = path, step_hash, samples
        self.records = [r for r in read_json_lines(path) if r.get("hash") == step_hash]

    def answered(self, kinds: list[str]) -> dict[SampleKey, list[SampleResult]]:
        """What an earlier attempt answered for this group of kinds, by sample."""
        out = {}
        for r in self.records:
            key = (r["task"], r["length"], r["index"])
            if r["kinds"] == kinds and key in self.samples:
                out[key] = [SampleResult.of(self.samples[key], result) for result in r["results"]]
        if out:
            log.info("%s: %d of %d samples answered by an earlier attempt (%s)", ", ".join(kinds), len(out),
                     len(self.samples), self.path.name)
        return out

    def add(self, kinds: list[str], sample: Sample, results: list[SampleResult]) -> None:
        append_json_line(self.path, {"hash": self.hash, "kinds": kinds, "task": sample.task, "length": sample.length,
                                     "index": sample.index, "results": [r.record() for r in results]})


def _write(out_dir: Path, rows: list[dict], answers: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out_dir / "eval_scores.csv", index=False)
    pd.DataFrame(answers).to_csv(out_dir / "eval_answers.csv", index=False)


def _summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per (cache kind, length): mean score and drop over the informative tasks, bytes ratio, seconds."""
    out = []
    for (kind, length), group in table.groupby(["cache_kind", "length"], sort=False):
        useful = group[group["informative"]]
        out.append({"cache_kind": kind, "length": length, "informative_tasks": len(useful),
                    "score": useful["score"].mean() if len(useful) else float("nan"),
                    "score_all_tasks": group["score"].mean(),
                    "drop": useful["drop"].mean() if len(useful) else float("nan"),
                    "cache_mib": group["cache_mib"].mean(), "bytes_ratio": group["bytes_ratio"].mean(),
                    "prefill_s": group["prefill_s"].mean()})
    return pd.DataFrame(out)


def _metrics(summary: pd.DataFrame) -> dict:
    """`<kind>_<length>.<figure>` per summary row (MLflow's names allow no '+': it becomes '_with_')."""
    out: dict[str, float] = {}
    for row in summary.to_dict("records"):
        name = re.sub(r"[^\w.\-:/ ]", "_", str(row["cache_kind"]).replace("+", "_with_")) + f"_{row['length']}"
        out |= {f"{name}.{k}": float(row[k]) for k in ("score", "drop", "cache_mib", "bytes_ratio", "prefill_s")
                if pd.notna(row[k])}
    return out


def _plot(summary: pd.DataFrame, path: Path) -> None:
    """Mean score over the informative tasks (over all, where none is) against the cache's bytes ÷ the
    reference's: one point per kind, one panel per length."""
    from matplotlib.figure import Figure

    lengths = list(dict.fromkeys(summary["length"]))
    fig = Figure(figsize=(5 * len(lengths), 4))
    for i, length in enumerate(lengths):
        ax = fig.add_subplot(1, len(lengths), i + 1)
        part = summary[summary["length"] == length]
        informative = part["score"].notna().any()  # else every task: none is informative at this length
        for row in part.to_dict("records"):
            y = row["score"] if informative else row["score_all_tasks"]
            ax.scatter(row["bytes_ratio"], y)
            ax.annotate(row["cache_kind"], (row["bytes_ratio"], y), fontsize=7)
        ax.set(xlabel="cache bytes ÷ reference", xlim=(0, 1.05), ylim=(-2, 102),
               ylabel=f"mean task score ({'informative' if informative else 'all, none informative'})",
               title=f"{length} tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
