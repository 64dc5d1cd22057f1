"""`mode: auto-cache-select`, and `cache_kind: auto` in `generate`: choose, show and record a cache kind.

Owns the step's metrics; choosing, showing and recording the selection (the table shown, the CSV / PNG / cache plan JSON
in the step folder) is runner.steps.shared's, which the generate step shares. The choosing itself is
runner.infer.select.autocache.
"""

from __future__ import annotations

from pathlib import Path

from runner.infer.config.decoding import GenerateConfig
from runner.infer.loading.models import LoadedModel
from runner.infer.select.autocache import Selection
from runner.manifest.blocks import GenerateBlock, library_config
from runner.manifest.plan import Step
from runner.report import ProgressFactory
from runner.steps.shared import describe_selection, select_for, selection_params, step_block


def run_cache_select(step: Step, lm: LoadedModel, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    block = step_block(GenerateBlock, step)
    selection = select_for(step, block, library_config(block, GenerateConfig), lm, base_dir, out_dir, progress)
    return {"selection": describe_selection(selection), "metrics": selection_metrics(selection),
            "params": selection_params(selection)}


def selection_metrics(selection: Selection) -> dict:
    metrics = {"selection_s": selection.seconds, "plan_reused": float(selection.reused),
               "plan_saved": float(not selection.persist_error)}
    for row in selection.rows:
        prefix = row["kind"] if selection.weights is None else f"{row['weights']}_{row['kind']}"
        for name in ("estimated_mib", "measured_mib", "delta_nll", "ppl_ratio", "mean_kl", "tokens_per_s",
                     "weight_mib", "total_mib"):
            if row.get(name) is not None:
                metrics[f"{prefix}.{name}"] = row[name]
    return metrics
