"""Executes a Plan: run folder, MLflow mirror, model reuse between steps, failure policy, resume.

Each step's result is written as soon as it exists, and `status.json` is updated before and after
every step, so a crash, Ctrl-C or kill -9 leaves a folder that says what finished; executing the plan
again into that folder skips the steps that finished with the same hash (`--resume`). A step that
fails for a user-facing reason (RunnerError) is recorded and the others go on (`on_failure: continue`)
or the rest are skipped (`on_failure: stop`); a bug is recorded and re-raised.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from runner.errors import ResourceError, RunnerError
from runner.manifest import Manifest
from runner.plan import Plan, Step
from runner.tracking import MlflowMirror, RunFolder, default_tracking_uri, environment


@dataclass
class Outcome:
    folder: Path
    failed: dict[str, str] = field(default_factory=dict)  # step key → reason
    reused: list[str] = field(default_factory=list)  # finished in an earlier (interrupted) invocation
    skipped: list[str] = field(default_factory=list)  # not run: on_failure: stop after a failure


_LOADED: list = []  # [(model spec json, LoadedModel)]: one model in memory, kept across the points of a sweep


def execute(manifest: Manifest, resolved: dict, plan: Plan, manifest_path: Path, folder: RunFolder,
            mlflow_parent: str | None = None, tags: dict | None = None, run_name: str | None = None) -> Outcome:
    """Run the plan's steps into `folder`, skipping steps that already finished there with the same hash.

    `mlflow_parent`: the sweep's run, when this is one point of a sweep; `tags` go on every MLflow run.
    """
    import torch  # noqa: F401  (imported here: planning and checking never pay for it)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder.write_text("manifest.resolved.yaml", yaml.safe_dump(resolved, sort_keys=False))
    folder.write_json("plan.json", plan.to_json())
    folder.write_json("env.json", environment())
    folder.set(name=manifest.name)
    print(f"[runner] run folder: {folder.path}", file=sys.stderr, flush=True)
    outcome = Outcome(folder.path)
    todo = []
    for step in plan.steps:
        if folder.finished(step.key, step.hash):
            outcome.reused.append(step.key)
            print(f"[runner] step {step.key} finished earlier (hash {step.hash[:12]}): skipped", file=sys.stderr)
        else:
            todo.append(step)
    tags = {"runner.run_folder": str(folder.path.resolve()), "runner.manifest": str(manifest_path), **(tags or {})}
    mirror = mirror_for(manifest)
    if not todo:  # resumed after its last step finished: its MLflow run may still say RUNNING (or KILLED)
        if mirror and folder.status.get("mlflow_run_id"):
            mirror.end_stale("runner.run_folder", tags["runner.run_folder"])
            mirror.end(folder.status["mlflow_run_id"], "FINISHED")
        folder.finish("finished")
        return outcome
    parent = _open_parent(mirror, folder, run_name or manifest.name, tags, mlflow_parent) if mirror else None
    state = "KILLED"
    try:
        for n, step in enumerate(todo):
            child = mirror.start(step.key, {**tags, "runner.step_hash": step.hash, "runner.mode": step.mode},
                                 parent=parent) if mirror else None
            folder.set_step(step.key, "running", hash=step.hash, mlflow_run_id=child)
            try:
                result = _run_step(step, _model_for(step, manifest_path.parent), manifest_path.parent,
                                   folder.path / step.key)
            except RunnerError as exc:
                outcome.failed[step.key] = str(exc)
                folder.set_step(step.key, "failed", error=str(exc))
                print(f"[runner] step {step.key} failed: {exc}", file=sys.stderr, flush=True)
                if mirror:
                    mirror.end(child, "FAILED")
                if manifest.on_failure == "stop":
                    outcome.skipped = [s.key for s in todo[n + 1:]]
                    for key in outcome.skipped:
                        folder.set_step(key, "skipped", reason=f"on_failure: stop after {step.key} failed")
                    break
                continue
            except BaseException as exc:
                folder.set_step(step.key, "interrupted" if isinstance(exc, KeyboardInterrupt) else "crashed",
                                error=repr(exc))
                if mirror:
                    mirror.end(child, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
                raise
            params, series = result.pop("params", {}), result.get("series", {})
            try:
                folder.write_json(f"{step.key}/results.json", result)
            except ResourceError as exc:
                if mirror:
                    mirror.end(child, "FAILED")
                raise ResourceError(f"{exc}; the step's results were saved to {_rescue(step, result)} instead") \
                    from None
            folder.set_step(step.key, "finished", metrics=result["metrics"])
            if mirror:
                mirror.log(child, params={"mode": step.mode, "model": step.model, step.mode: step.spec,
                                          "seed": step.seed, "model_fingerprint": result["model"], **params},
                           metrics=result["metrics"], artifacts=folder.path / step.key, series=series)
                mirror.end(child, "FINISHED")
        state = "FAILED" if outcome.failed or outcome.skipped else "FINISHED"
    finally:
        try:
            folder.finish({"FINISHED": "finished", "FAILED": "failed"}.get(state, "interrupted"))
        except ResourceError as exc:  # the folder stopped taking writes: say so, keep the first error
            print(f"[runner] {exc}", file=sys.stderr, flush=True)
        if mirror:
            mirror.log(parent, params={"manifest": manifest.name, "seed": manifest.seed}, artifacts=folder.path)
            mirror.end(parent, state)
    return outcome


def _rescue(step: Step, result: dict) -> Path:
    """Where a step's results go when the run folder cannot take them: the system's temporary folder."""
    handle, name = tempfile.mkstemp(prefix=f"runner-{step.key.replace('/', '-')}-", suffix=".json")
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    return Path(name)


def _open_parent(mirror: MlflowMirror, folder: RunFolder, name: str, tags: dict, sweep_run: str | None) -> str:
    """The folder's MLflow run: the one it had before when resumed (its killed children end KILLED first)."""
    mirror.end_stale("runner.run_folder", tags["runner.run_folder"])
    previous = folder.status.get("mlflow_run_id")
    run_id = mirror.reopen(previous) if previous else None
    if run_id is None:
        run_id = mirror.start(name, tags, parent=sweep_run)
    folder.set(mlflow_run_id=run_id)
    return run_id


def _model_for(step: Step, base_dir: Path):
    spec_key = json.dumps([step.model, step.model_seed, str(base_dir.resolve())], sort_keys=True)
    if not _LOADED or _LOADED[0][0] != spec_key:
        _LOADED.clear()  # free the previous model before loading the next
        _LOADED.append((spec_key, _load(step, base_dir)))
    return _LOADED[0][1]


def mirror_for(manifest: Manifest) -> MlflowMirror | None:
    tracking = manifest.tracking
    if not tracking.mlflow:
        return None
    runs_dir = Path(tracking.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking.tracking_uri or default_tracking_uri(runs_dir)
    return MlflowMirror(uri, tracking.experiment or manifest.name, runs_dir / "mlartifacts")


def _load(step: Step, base_dir: Path):
    from runner.infer.models import load_spec
    from runner.paths import model_source

    spec = step.model
    print(f"[runner] loading {spec.get('id') or 'config model'} ({spec['dtype']}, {spec['device']})",
          file=sys.stderr, flush=True)
    return load_spec(model_source(spec, base_dir), step.model_seed, base_dir)


def _run_step(step: Step, lm, base_dir: Path, out_dir: Path) -> dict:
    import torch

    from runner.steps import STEP_RUNNERS

    try:
        result = STEP_RUNNERS[step.mode](step, lm, base_dir, out_dir)
    except torch.OutOfMemoryError as exc:
        raise ResourceError(f"out of memory in step {step.key}: {exc}") from None
    return {"step": step.key, "mode": step.mode, "hash": step.hash, "seed": step.seed, "model": lm.fingerprint,
            "spec": step.spec, **result}
