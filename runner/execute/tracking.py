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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from runner import __version__
from runner.errors import ResourceError, RunnerError
from runner.files import atomic_write

log = logging.getLogger(__name__)


class RunFolder:
    """`<runs_dir>/<utc-stamp>-<name>/` (or a given folder, e.g. a sweep point's) with atomic JSON writes.

    `status.json` holds the folder's state, each step's state and hash, and the MLflow run ids, so
    `open()` can resume it after Ctrl-C, kill -9 or a crash.
    """

    def __init__(self, path: Path, status: dict):
        self.path = path
        self.status = status

    @classmethod
    def create(cls, runs_dir: str | Path, name: str) -> RunFolder:
        return cls(new_folder(runs_dir, name), {"state": "running", "started": utc_now(), "pid": os.getpid(),
                                                "steps": {}})

    @classmethod
    def at(cls, path: Path) -> RunFolder:
        """The folder at `path`: reopened with its status when it has one, else started empty."""
        status_file = path / "status.json"
        if status_file.is_file():
            status = json.loads(status_file.read_text(encoding="utf-8"))
            status.update(state="running", resumed=utc_now(), pid=os.getpid())
        else:
            path.mkdir(parents=True, exist_ok=True)
            status = {"state": "running", "started": utc_now(), "pid": os.getpid(), "steps": {}}
        return cls(path, status)

    def finished(self, key: str, step_hash: str) -> bool:
        """The step `key` with this exact hash finished here before (status and results on disk)."""
        entry = self.status["steps"].get(key, {})
        return (entry.get("state") == "finished" and entry.get("hash") == step_hash
                and (self.path / key / "results.json").is_file())

    def set(self, **info) -> None:
        self.status.update(info)
        self.write_json("status.json", self.status)

    def write_json(self, relative: str, data) -> Path:
        return self.write_text(relative, json.dumps(data, indent=2, default=str) + "\n")

    def write_text(self, relative: str, text: str) -> Path:
        target = self.path / relative
        try:
            atomic_write(target, text)
        except OSError as exc:
            raise ResourceError(f"cannot write {target}: {exc.strerror or exc} (disk full or not writable?)") from None
        return target

    def set_step(self, key: str, state: str, **info) -> None:
        self.status["steps"][key] = {**self.status["steps"].get(key, {}), "state": state, "at": utc_now(), **info}
        self.write_json("status.json", self.status)

    def finish(self, state: str) -> None:
        self.status.update(state=state, ended=utc_now())
        self.write_json("status.json", self.status)


class Tracker:
    """Opens and ends runs; MlflowMirror does it in an MLflow store, NoTracking nowhere."""

    def start(self, name: str, tags: dict, parent: str | None = None) -> str | None:
        raise NotImplementedError

    def reopen(self, run_id: str) -> str | None:
        raise NotImplementedError

    def end(self, run_id: str | None, state: str) -> None:
        raise NotImplementedError

    def end_stale(self, tag: str, value: str) -> list[str]:
        raise NotImplementedError

    def log(self, run_id: str | None, params: dict | None = None, metrics: dict | None = None,
            artifacts: Path | None = None, artifact_path: str | None = None, series: dict | None = None) -> None:
        raise NotImplementedError

    @contextmanager
    def run(self, name: str, tags: dict, parent: str | None = None,
            resume: str | None = None) -> Iterator[TrackedRun]:
        """A run open for the block (the `resume` run reopened when this store has it, else a new one nested under
        `parent`), ended by how the block exits: normally → `run.state` (FINISHED unless set to FAILED),
        KeyboardInterrupt → KILLED, any other exception → FAILED."""
        run_id = (self.reopen(resume) if resume else None) or self.start(name, tags, parent)
        run = TrackedRun(self, run_id)
        try:
            yield run
        except KeyboardInterrupt:
            self.end(run_id, "KILLED")
            raise
        except BaseException:
            self.end(run_id, "FAILED")
            raise
        self.end(run_id, run.state)


class MlflowMirror(Tracker):
    """Runs nested as sweep → manifest (or sweep point) → step; explicit client, no global active run.

    Every call to the store holds a file lock beside it: processes sharing one sqlite store (parallel
    sweep points, runs started side by side) would otherwise race its creation and migrations. A store that fails
    mid-run (a server that hangs or goes away, a full disk) loses the mirror, not the run: said once, at error
    level; the later calls are skipped and the run folder keeps everything."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path):
        from filelock import FileLock

        quiet_mlflow()
        http_timeouts()
        self.uri, self.lost = tracking_uri, ""
        from mlflow.tracking import MlflowClient

        artifact_root.parent.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(artifact_root.parent / ".mlflow.lock"))
        with self.lock:  # the client creates (and migrates) the store; one process creates the experiment
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            # A tracking server keeps the artifacts itself (`mlflow server --serve-artifacts`: uploads over HTTP)
            location = None if tracking_uri.startswith(("http://", "https://")) else artifact_root.resolve().as_uri()
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=location)

    def start(self, name: str, tags: dict, parent: str | None = None) -> str | None:
        """A new run, nested under `parent` (a run id) when given."""
        if parent:
            tags = {**tags, "mlflow.parentRunId": parent}
        run = self._call(f"starting run {name}", self.client.create_run, self.experiment_id, run_name=name,
                         tags={k: str(v) for k, v in tags.items()})
        return run.info.run_id if run else None

    def _call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the store, under its lock; None, said once, when the store fails."""
        if self.lost:
            return None
        try:
            with self.lock:
                return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- MLflow raises its own, requests' and OS errors alike
            self.lost = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.error("MLflow at %s failed while %s (%s): the run goes on without it; its run folder keeps every "
                      "result", self.uri, what, self.lost)
            return None

    def reopen(self, run_id: str) -> str | None:
        """A resumed folder's run goes on in the same MLflow run instead of a duplicate; None if this
        store does not have it (e.g. the tracking URI changed since)."""
        from mlflow.exceptions import MlflowException

        if self.lost:
            return None
        try:
            with self.lock:
                self.client.update_run(run_id, status="RUNNING")
        except MlflowException:  # not in this store (or the store failed: starting a run will say so)
            return None
        return run_id

    def end_stale(self, tag: str, value: str) -> list[str]:
        """Runs tagged `tag=value` still RUNNING (their process was killed, e.g. kill -9) end KILLED."""
        def end_them() -> list[str]:
            runs = self.client.search_runs([self.experiment_id], filter_string=(
                f"attributes.status = 'RUNNING' and tags.`{tag}` = '{value}'"), max_results=10_000)
            for run in runs:
                self.client.set_terminated(run.info.run_id, "KILLED")
            return [run.info.run_id for run in runs]

        return self._call("ending stale runs", end_them) or []

    def log(self, run_id: str | None, params: dict | None = None, metrics: dict | None = None,
            artifacts: Path | None = None, artifact_path: str | None = None, series: dict | None = None) -> None:
        """`series`: name → list of values, logged as one metric's history (step = index), e.g. k per round."""
        from mlflow.entities import Metric, Param

        if run_id is None:  # the store failed before this run started
            return
        now = int(datetime.now(timezone.utc).timestamp() * 1000)
        history = [Metric(k, float(v), now, step) for k, values in (series or {}).items()
                   for step, v in enumerate(values)]
        param_list = [Param(k, _param_value(v)) for k, v in flatten(params or {}).items()]
        metric_list = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if v is not None] + history
        def send() -> None:
            for start in range(0, len(param_list), 100):  # MLflow takes at most 100 params and 1000 metrics a call
                self.client.log_batch(run_id, params=param_list[start:start + 100])
            for start in range(0, len(metric_list), 1000):
                self.client.log_batch(run_id, metrics=metric_list[start:start + 1000])
            if artifacts is not None:
                self.client.log_artifacts(run_id, str(artifacts), artifact_path)

        self._call("logging results", send)

    def end(self, run_id: str | None, state: str) -> None:
        """state: FINISHED, FAILED or KILLED."""
        if run_id is not None:
            self._call(f"ending a run {state}", self.client.set_terminated, run_id, state)


def http_timeouts() -> None:
    """MLflow's HTTP calls fail in tens of seconds, not after minutes of silent retries (unless the user set them)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")


@dataclass
class TrackedRun:
    """An open run: `log` to it; set `state = "FAILED"` to end it failed without raising."""

    mirror: Tracker
    id: str | None
    state: str = "FINISHED"

    def log(self, **what) -> None:
        """As MlflowMirror.log (params, metrics, artifacts, series), to this run."""
        self.mirror.log(self.id, **what)


class NoTracking(Tracker):
    """`tracking: {mlflow: false}`: the same calls, no store; runs have no id."""

    def start(self, name: str, tags: dict, parent: str | None = None) -> None:
        return None

    def reopen(self, run_id: str) -> None:
        return None

    def end_stale(self, tag: str, value: str) -> list[str]:
        return []

    def log(self, run_id: str | None, params: dict | None = None, metrics: dict | None = None,
            artifacts: Path | None = None, artifact_path: str | None = None, series: dict | None = None) -> None:
        pass

    def end(self, run_id, state: str) -> None:
        pass


def tracker_for(tracking, default_experiment: str) -> Tracker:
    """A manifest's `tracking:` block → its MLflow mirror, or NoTracking when mlflow is off."""
    if not tracking.mlflow:
        return NoTracking()
    runs_dir = Path(tracking.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    return MlflowMirror(tracking.tracking_uri or default_tracking_uri(runs_dir),
                        tracking.experiment or default_experiment, runs_dir / "mlartifacts")


RUN_ADVICE = ("set tracking.mlflow=false, or leave tracking.tracking_uri out to keep runs in <runs_dir>/mlflow.db (a "
              "local store); nothing ran")


def require_server(uri: str | None, what: str, advice: str = RUN_ADVICE, timeout_s: float = 5.0) -> None:
    """An HTTP tracking server that does not answer is a RunnerError now, within `timeout_s`, before any work:
    MLflow itself would retry for minutes, silently. Any HTTP answer (an error status too) counts as an answer."""
    if not uri or not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered (behind a proxy or an auth layer, /health may say no: MLflow's calls will tell)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        said = f"no answer within {timeout_s:g} s" if isinstance(reason, TimeoutError) or "timed out" in str(reason) \
            else getattr(reason, "strerror", None) or str(reason)
        raise RunnerError(f"{what}: the MLflow server at {uri} does not answer ({said}): start it (mlflow server "
                          f"--host HOST --port PORT), or {advice}") from None


def quiet_mlflow() -> None:
    """No artifact progress bars, no alembic/mlflow info chatter."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # noqa: F401  (sets its own logger levels on import: override them after)

    for noisy in ("alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def new_folder(runs_dir: str | Path, name: str) -> Path:
    """A fresh `<runs_dir>/<utc-stamp>-<name>[-N]`; mkdir is the claim, so parallel processes never share one."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = Path(runs_dir)
    try:
        base.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            path = base / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise RunnerError(f"cannot create the run folder under {base.resolve()}: {exc.strerror}") from None
    raise RunnerError(f"cannot create the run folder under {base.resolve()}: too many folders named {stamp}-{name}")


def latest_unfinished(runs_dir: str | Path, name: str, record: str) -> Path | None:
    """The newest folder directly under `runs_dir` whose `record` file (status.json or sweep.json) names
    `name` and whose state is not finished: what `--resume` without a folder picks."""
    found = []
    for path in Path(runs_dir).glob(f"*-{name}*"):
        try:
            data = json.loads((path / record).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("name") == name and data.get("state") != "finished":
            found.append((data.get("started", ""), path.name, path))
    return max(found)[2] if found else None


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

    from runner.infer.measure.timing import device_name

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


def utc_now() -> str:
    """Now in UTC, to the second, as ISO 8601: the times in status.json and sweep.json."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
