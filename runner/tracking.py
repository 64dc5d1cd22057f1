"""Where results go: the run folder on disk and its MLflow mirror. The only importer of mlflow.

The run folder is the record of truth (`status.json` says what finished, even after a crash);
MLflow gets one parent run per invocation and one child per step, with flattened params, metrics
and the step's folder as artifacts. Does not know how steps compute anything.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from runner import __version__
from runner.errors import ResourceError, RunnerError


class RunFolder:
    """`<runs_dir>/<utc-stamp>-<name>/` with atomic JSON writes."""

    def __init__(self, runs_dir: str | Path, name: str):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        base = Path(runs_dir)
        try:
            base.mkdir(parents=True, exist_ok=True)
            path, n = base / f"{stamp}-{name}", 1
            while path.exists():
                n += 1
                path = base / f"{stamp}-{name}-{n}"
            path.mkdir()
        except OSError as exc:
            raise RunnerError(f"cannot create the run folder under {base.resolve()}: {exc.strerror}") from None
        self.path = path
        self.status = {"state": "running", "started": _now(), "steps": {}}

    def write_json(self, relative: str, data) -> Path:
        return self.write_text(relative, json.dumps(data, indent=2, default=str) + "\n")

    def write_text(self, relative: str, text: str) -> Path:
        target = self.path / relative
        tmp = target.with_name(target.name + ".tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ResourceError(f"cannot write {target}: {exc.strerror or exc} (disk full or not writable?)") from None
        return target

    def set_step(self, key: str, state: str, **info) -> None:
        self.status["steps"][key] = {**self.status["steps"].get(key, {}), "state": state, "at": _now(), **info}
        self.write_json("status.json", self.status)

    def finish(self, state: str) -> None:
        self.status.update(state=state, ended=_now())
        self.write_json("status.json", self.status)


class MlflowMirror:
    """Parent run per invocation, child run per step; explicit client, no global active run.

    Every call to the store holds a file lock beside it: processes sharing one sqlite store (parallel
    sweep points, runs started side by side) would otherwise race its creation and migrations."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path):
        from filelock import FileLock

        quiet_mlflow()
        from mlflow.tracking import MlflowClient

        artifact_root.parent.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(artifact_root.parent / ".mlflow.lock"))
        with self.lock:  # the client creates (and migrates) the store
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=artifact_root.resolve().as_uri())
        self.parent_id: str | None = None

    def start(self, name: str, tags: dict, parent: bool = False) -> str:
        if not parent:
            tags = {**tags, "mlflow.parentRunId": self.parent_id}
        with self.lock:
            run = self.client.create_run(self.experiment_id, run_name=name,
                                         tags={k: str(v) for k, v in tags.items()})
        if parent:
            self.parent_id = run.info.run_id
        return run.info.run_id

    def log(self, run_id: str, params: dict | None = None, metrics: dict | None = None,
            artifacts: Path | None = None, artifact_path: str | None = None, series: dict | None = None) -> None:
        """`series`: name → list of values, logged as one metric's history (step = index), e.g. k per round."""
        from mlflow.entities import Metric, Param

        now = int(datetime.now(timezone.utc).timestamp() * 1000)
        history = [Metric(k, float(v), now, step) for k, values in (series or {}).items()
                   for step, v in enumerate(values)]
        params = [Param(k, _param_value(v)) for k, v in flatten(params or {}).items()]
        metrics = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if v is not None] + history
        with self.lock:
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params and 1000 metrics a call
                self.client.log_batch(run_id, params=params[start:start + 100])
            for start in range(0, len(metrics), 1000):
                self.client.log_batch(run_id, metrics=metrics[start:start + 1000])
            if artifacts is not None:
                self.client.log_artifacts(run_id, str(artifacts), artifact_path)

    def end(self, run_id: str, state: str) -> None:
        """state: FINISHED, FAILED or KILLED."""
        with self.lock:
            self.client.set_terminated(run_id, state)


def quiet_mlflow() -> None:
    """No artifact progress bars, no alembic/mlflow info chatter."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # noqa: F401  (sets its own logger levels on import: override them after)

    for noisy in ("alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def default_tracking_uri(runs_dir: str | Path) -> str:
    return f"sqlite:///{Path(runs_dir).resolve() / 'mlflow.db'}"


def flatten(data: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay values."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _param_value(value) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= 500 else text[:497] + "..."


def environment() -> dict:
    """Versions and hardware, for env.json: what could change a result besides the manifest."""
    import torch
    import transformers

    from runner.infer.bench import device_name

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "runner": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "git_sha": _git_sha(),
        "argv": sys.argv,
    }


def _git_sha() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
