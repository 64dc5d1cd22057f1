"""Executes a Plan: run folder, MLflow mirror, model reuse between steps, failure bookkeeping.

Each step's result is written as soon as it exists, and `status.json` is updated before and after
every step, so a crash or Ctrl-C leaves a folder that says what finished. A step that fails for a
user-facing reason (RunnerError) is recorded and the others go on; a bug is recorded and re-raised.
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


def execute(manifest: Manifest, resolved: dict, plan: Plan, manifest_path: Path) -> Outcome:
    import torch  # noqa: F401  (imported here: planning and checking never pay for it)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = RunFolder(manifest.tracking.runs_dir, manifest.name)
    folder.write_text("manifest.resolved.yaml", yaml.safe_dump(resolved, sort_keys=False))
    folder.write_json("plan.json", plan.to_json())
    folder.write_json("env.json", environment())
    print(f"[runner] run folder: {folder.path}", file=sys.stderr, flush=True)
    mirror = _mirror(manifest)
    parent = mirror.start(manifest.name, {"runner.manifest": str(manifest_path)}, parent=True) if mirror else None
    outcome = Outcome(folder.path)
    loaded: tuple[str, object] | None = None  # (model spec json, LoadedModel): one model in memory at a time
    state = "KILLED"
    try:
        for step in plan.steps:
            folder.set_step(step.key, "running", hash=step.hash)
            tags = {"runner.step_hash": step.hash, "runner.mode": step.mode}
            child = mirror.start(step.key, tags) if mirror else None
            try:
                spec_key = json.dumps([step.model, step.model_seed], sort_keys=True)
                if loaded is None or loaded[0] != spec_key:
                    loaded = None  # free the previous model before loading the next
                    loaded = (spec_key, _load(step, manifest_path.parent))
                result = _run_step(step, loaded[1], manifest_path.parent, folder.path / step.key)
            except RunnerError as exc:
                outcome.failed[step.key] = str(exc)
                folder.set_step(step.key, "failed", error=str(exc))
                print(f"[runner] step {step.key} failed: {exc}", file=sys.stderr, flush=True)
                if mirror:
                    mirror.end(child, "FAILED")
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
        state = "FAILED" if outcome.failed else "FINISHED"
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


def _mirror(manifest: Manifest) -> MlflowMirror | None:
    tracking = manifest.tracking
    if not tracking.mlflow:
        return None
    runs_dir = Path(tracking.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking.tracking_uri or default_tracking_uri(runs_dir)
    return MlflowMirror(uri, tracking.experiment or manifest.name, runs_dir / "mlartifacts")


def _load(step: Step, base_dir: Path):
    from runner.infer.models import load_model

    spec = step.model
    print(f"[runner] loading {spec.get('id') or 'config model'} ({spec['dtype']}, {spec['device']})",
          file=sys.stderr, flush=True)
    return load_model(spec.get("id"), config=spec.get("config"), dtype=spec["dtype"], device=spec["device"],
                      revision=spec.get("revision"), trust_remote_code=spec["trust_remote_code"],
                      seed=step.model_seed, base_dir=base_dir)


def _run_step(step: Step, lm, base_dir: Path, out_dir: Path) -> dict:
    import torch

    from runner.steps import STEP_RUNNERS

    try:
        result = STEP_RUNNERS[step.mode](step, lm, base_dir, out_dir)
    except torch.OutOfMemoryError as exc:
        raise ResourceError(f"out of memory in step {step.key}: {exc}") from None
    return {"step": step.key, "mode": step.mode, "hash": step.hash, "seed": step.seed, "model": lm.fingerprint,
            "spec": step.spec, **result}
