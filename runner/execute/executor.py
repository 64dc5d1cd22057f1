"""Executes a step plan: run folder, MLflow mirror, model reuse between steps, failure policy, resume.

Each step's result is written as soon as it exists, and `status.json` is updated before and after
every step, so a crash, Ctrl-C or kill -9 leaves a folder that says what finished; executing the plan
again into that folder skips the steps that finished with the same hash (`--resume`). A step that
fails for a user-facing reason (RunnerError) is recorded and the others go on (`on_failure: continue`)
or the rest are skipped (`on_failure: stop`); a bug is recorded and re-raised.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from transformers.utils import logging as hf_logging

from runner.errors import ResourceError, RunnerError
from runner.execute.tracking import RunFolder, Tracker, environment, tracker_for
from runner.files import atomic_write_json
from runner.infer.loading.models import load_model_block
from runner.manifest.paths import model_source
from runner.manifest.plan import Step, StepPlan
from runner.manifest.schema import Manifest
from runner.report import ProgressFactory, no_progress
from runner.steps import STEP_RUNNERS

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    folder: Path
    failed: dict[str, str] = field(default_factory=dict)  # step key → reason
    reused: list[str] = field(default_factory=list)  # finished in an earlier (interrupted) invocation
    skipped: list[str] = field(default_factory=list)  # not run: on_failure: stop after a failure


class LoadedModels:
    """Model reuse across steps and sweep points: holds one model in memory, keyed by its block; a different block
    frees the previous model before loading the next. Passed in explicitly (a sweep shares one across its points)."""

    def __init__(self):
        self.key: str | None = None
        self.model = None

    def get(self, step: Step, base_dir: Path):
        key = json.dumps([step.model, step.model_seed, str(base_dir.resolve())], sort_keys=True)
        if key != self.key:
            self.key, self.model = None, None  # free the previous model before loading the next
            block = step.model
            log.info("loading %s (%s, %s)", block.get("id") or "config model", block["dtype"], block["device"])
            self.model, self.key = load_model_block(model_source(block, base_dir), step.model_seed, base_dir), key
        return self.model


@dataclass(frozen=True)
class ParentRun:
    """The MLflow run an execution hangs under (a sweep's, for one of its points): its id, the tags that go on every
    run of the execution, and the name of the execution's own run."""

    id: str
    tags: dict
    name: str


@dataclass(frozen=True)
class RunContext:
    """What every step of one execution shares: where it runs and records, and what it reuses."""

    manifest: Manifest
    base_dir: Path  # the manifest's folder: where its relative input files are
    folder: RunFolder
    tracker: Tracker
    parent: str | None  # the execution's MLflow run: each step's run is its child
    tags: dict  # on every step's MLflow run
    models: LoadedModels
    progress: ProgressFactory


def execute(manifest: Manifest, resolved: dict, plan: StepPlan, manifest_path: Path, folder: RunFolder,
            parent: ParentRun | None = None, models: LoadedModels | None = None,
            progress: ProgressFactory = no_progress) -> Outcome:
    """Run the plan's steps into `folder`, skipping steps that already finished there with the same hash.

    `parent`: the sweep's run, when this is one point of a sweep; `models`: the models already loaded (a sweep's
    earlier points); `progress`: how long steps report.
    """
    hf_logging.disable_progress_bar()
    folder.write_text("manifest.resolved.yaml", yaml.safe_dump(resolved, sort_keys=False))
    folder.write_json("plan.json", plan.to_json())
    folder.write_json("env.json", environment())
    folder.set(name=manifest.name)
    log.info("run folder: %s", folder.path)
    outcome = Outcome(folder.path)
    todo = []
    for step in plan.steps:
        if folder.finished(step.key, step.hash):
            outcome.reused.append(step.key)
            log.info("step %s finished earlier (hash %s): skipped", step.key, step.hash[:12])
        else:
            todo.append(step)
    tags = {"runner.run_folder": str(folder.path.resolve()), "runner.manifest": str(manifest_path),
            **(parent.tags if parent else {})}
    tracker = tracker_for(manifest.tracking, manifest.name)
    tracker.end_stale("runner.run_folder", tags["runner.run_folder"])  # children of a killed earlier invocation
    if not todo:  # resumed after its last step finished: its MLflow run may still say RUNNING (or KILLED)
        tracker.end(folder.status.get("mlflow_run_id"), "FINISHED")
        folder.finish("finished")
        return outcome
    with tracker.run(parent.name if parent else manifest.name, tags, parent=parent.id if parent else None,
                     resume=folder.status.get("mlflow_run_id")) as run:
        folder.set(mlflow_run_id=run.id)
        state = "interrupted"
        try:
            context = RunContext(manifest, manifest_path.parent, folder, tracker, run.id, tags,
                                 models or LoadedModels(), progress)
            _run_steps(todo, context, outcome)
            state = "failed" if outcome.failed or outcome.skipped else "finished"
            run.state = "FAILED" if state == "failed" else "FINISHED"
        finally:
            try:
                folder.finish(state)
            except ResourceError as exc:  # the folder stopped taking writes: say so, keep the first error
                log.error("%s", exc)
            run.log(params={"manifest": manifest.name, "seed": manifest.seed}, artifacts=folder.path)
    return outcome


def _run_steps(todo: list[Step], context: RunContext, outcome: Outcome) -> None:
    """Each step in its own MLflow run; a RunnerError fails that step alone (on_failure: continue) or skips the rest
    (on_failure: stop); anything else is recorded in status.json and goes up."""
    folder = context.folder
    for n, step in enumerate(todo):
        with context.tracker.run(step.key, {**context.tags, "runner.step_hash": step.hash, "runner.mode": step.mode},
                                 parent=context.parent) as child:
            folder.set_step(step.key, "running", hash=step.hash, mlflow_run_id=child.id)
            try:
                result = _run_step(step, context.models.get(step, context.base_dir), context.base_dir,
                                   folder.path / step.key, context.progress)
            except RunnerError as exc:
                outcome.failed[step.key], child.state = str(exc), "FAILED"
                folder.set_step(step.key, "failed", error=str(exc))
                log.error("step %s failed: %s", step.key, exc)
                if context.manifest.on_failure == "stop":
                    outcome.skipped = [s.key for s in todo[n + 1:]]
                    for key in outcome.skipped:
                        folder.set_step(key, "skipped", reason=f"on_failure: stop after {step.key} failed")
                    return
                continue
            except BaseException as exc:
                how = "interrupted" if isinstance(exc, KeyboardInterrupt) else "crashed"
                folder.set_step(step.key, how, error=repr(exc))
                for later in todo[n + 1:]:  # the folder says what did not run; a rerun runs them
                    folder.set_step(later.key, "skipped", reason=f"not run: {step.key} {how}")
                raise
            params, series = result.pop("params", {}), result.get("series", {})
            try:
                folder.write_json(f"{step.key}/results.json", result)
            except ResourceError as exc:
                raise ResourceError(f"{exc}; the step's results were saved to {_rescue(step, result)} instead") \
                    from None
            folder.set_step(step.key, "finished", metrics=result["metrics"])
            child.log(params={"mode": step.mode, "model": step.model, step.mode: step.block, "seed": step.seed,
                              "model_fingerprint": result["model"], **params},
                      metrics=result["metrics"], artifacts=folder.path / step.key, series=series)


def _rescue(step: Step, result: dict) -> Path:
    """Where a step's results go when the run folder cannot take them: the system's temporary folder."""
    handle, name = tempfile.mkstemp(prefix=f"runner-{step.key.replace('/', '-')}-", suffix=".json")
    os.close(handle)
    return atomic_write_json(name, result)


def _run_step(step: Step, lm, base_dir: Path, out_dir: Path, progress: ProgressFactory) -> dict:
    try:
        result = STEP_RUNNERS[step.mode](step, lm, base_dir, out_dir, progress)
    except torch.OutOfMemoryError as exc:
        raise ResourceError(f"out of memory in step {step.key}: {exc}") from None
    return {"step": step.key, "mode": step.mode, "hash": step.hash, "seed": step.seed, "model": lm.fingerprint,
            "spec": step.block, **result}
