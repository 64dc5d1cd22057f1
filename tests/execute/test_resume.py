"""Resume: a run or sweep interrupted (SIGINT, kill -9) and run again with --resume skips the steps that
finished (by hash) and does the rest; MLflow ends with one finished run per step, the interrupted ones
KILLED, none left RUNNING."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

RUNS = """      - id: first
        mode: generate
        generate: {prompts: ["hello"], max_new_tokens: 4, temperature: 0}
      - id: long
        mode: generate
        generate: {prompts: ["x"], max_new_tokens: 100000, max_seq_len: 200000, temperature: 1.0, eos_token_id: []}
      - id: last
        mode: generate
        generate: {prompts: ["bye"], max_new_tokens: 4, temperature: 0}
"""
SHORTEN = "targets.0.runs.1.generate.max_new_tokens=3"  # changes only step long's hash


def _start(*args, cwd):
    return subprocess.Popen([sys.executable, "-m", "runner", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait_for(pattern: str, marker: str, tmp_path, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for status in (tmp_path / "runs").glob(pattern):
            try:
                steps = json.loads(status.read_text())["steps"]
            except (OSError, ValueError):
                continue
            if steps.get(marker, {}).get("state") == "running":
                return status
        time.sleep(0.1)
    raise AssertionError(f"{marker} never started")


def _runs_by_name(tmp_path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    out = defaultdict(list)
    for run in client.search_runs([client.get_experiment_by_name("t").experiment_id]):
        out[run.info.run_name].append(run.info.status)
    return {name: sorted(states) for name, states in out.items()}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
@pytest.mark.e2e
def test_interrupted_run_resumes_skipping_finished_steps_without_duplicates_in_mlflow(tmp_path, sig):
    path = tiny_manifest(tmp_path, RUNS)
    proc = _start(path, cwd=tmp_path)
    status_file = _wait_for("*/status.json", "tiny/long", tmp_path)
    time.sleep(0.5)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else -9)
    first_result = status_file.parent / "tiny" / "first" / "results.json"
    written = first_result.stat().st_mtime_ns
    before = _runs_by_name(tmp_path)
    assert before["tiny/long"] == (["KILLED"] if sig == signal.SIGINT else ["RUNNING"])

    done = run_cli(path, SHORTEN, "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"resuming {status_file.parent}" in done.stderr and "tiny/first finished earlier" in done.stderr
    assert "1 step finished earlier, 2 run now" in done.stderr
    assert first_result.stat().st_mtime_ns == written  # not recomputed
    assert len([p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]) == 1
    status = json.loads(status_file.read_text())
    assert status["state"] == "finished" and {s["state"] for s in status["steps"].values()} == {"finished"}
    assert _runs_by_name(tmp_path) == {"t": ["FINISHED"], "tiny/first": ["FINISHED"],
                                       "tiny/long": ["FINISHED", "KILLED"], "tiny/last": ["FINISHED"]}
    again = run_cli(path, SHORTEN, "--resume", cwd=tmp_path)  # nothing left unfinished
    assert again.returncode == 2 and "no unfinished run of 't'" in again.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
@pytest.mark.e2e
def test_interrupted_sweep_resumes_the_unfinished_point_only(tmp_path, sig):
    runs = RUNS.split("      - id: long")[0]
    path = tiny_manifest(tmp_path, runs.replace("max_new_tokens: 4, temperature: 0",
                                                "max_new_tokens: 4, max_seq_len: 100000, eos_token_id: []"))
    sweep = ["-m", "targets.0.runs.0.generate.max_new_tokens=4,1500"]
    proc = _start(path, *sweep, cwd=tmp_path)
    _wait_for("*/1/status.json", "tiny/first", tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else -9) and "Traceback" not in err
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    state, left = ("interrupted", "KILLED") if sig == signal.SIGINT else ("running", "RUNNING")
    assert json.loads((folder / "sweep.json").read_text())["state"] == state
    # point 0 and its step finished; the sweep, point 1 and its step were running when interrupted
    assert sorted(sum(_runs_by_name(tmp_path).values(), [])) == ["FINISHED"] * 2 + [left] * 3
    done = run_cli(path, *sweep, "--resume", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"resuming {folder}" in done.stderr and "[runner] point 1:" in done.stderr
    assert "step tiny/first finished earlier" in done.stderr  # point 0, by hash
    record = json.loads((folder / "sweep.json").read_text())
    assert record["state"] == "finished" and [p["state"] for p in record["points"]] == ["finished", "finished"]
    runs = _runs_by_name(tmp_path)
    assert runs["t (sweep)"] == ["FINISHED"] and runs["tiny/first"] == ["FINISHED", "FINISHED", "KILLED"]
    assert sorted(k for k in runs if k.startswith("t[")) == ["t[0] targets.0.runs.0.generate.max_new_tokens=4",
                                                            "t[1] targets.0.runs.0.generate.max_new_tokens=1500"]
    assert all(states == ["FINISHED"] for name, states in runs.items() if name.startswith("t["))


@pytest.mark.e2e
def test_resume_of_a_changed_sweep_is_refused(tmp_path):
    path = tiny_manifest(tmp_path, RUNS.split("      - id: long")[0])
    assert run_cli(path, "-m", "seed=1", "tracking.mlflow=false", cwd=tmp_path).returncode == 0
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    done = run_cli(path, "-m", "seed=1,2", "--resume-from", folder, "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 2 and "its points differ" in done.stderr and "Traceback" not in done.stderr
