"""MLflow runs as context managers, on a real sqlite store: how the block exits decides how the run ends."""

import pytest
from mlflow.tracking import MlflowClient

from runner.execute.tracking import MlflowMirror, NoTracking, default_tracking_uri


@pytest.fixture
def mirror(tmp_path):
    return MlflowMirror(default_tracking_uri(tmp_path), "tracking-test", tmp_path / "mlartifacts")


def _status(mirror: MlflowMirror, run_id: str) -> str:
    return MlflowClient(tracking_uri=mirror.client.tracking_uri).get_run(run_id).info.status


def test_a_block_that_ends_normally_finishes_its_run_with_what_was_logged(mirror):
    with mirror.run("parent", {"runner.manifest": "m.yaml"}) as parent:
        with mirror.run("step", {}, parent=parent.id) as child:
            child.log(params={"mode": "generate"}, metrics={"tokens_per_s": 12.5})
    run = MlflowClient(tracking_uri=mirror.client.tracking_uri).get_run(child.id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"tokens_per_s": 12.5}
    assert run.data.tags["mlflow.parentRunId"] == parent.id and _status(mirror, parent.id) == "FINISHED"


def test_a_failure_recorded_without_raising_ends_failed(mirror):
    with mirror.run("step", {}) as run:
        run.state = "FAILED"
    assert _status(mirror, run.id) == "FAILED"


@pytest.mark.parametrize("exc, state", [(KeyboardInterrupt, "KILLED"), (ValueError, "FAILED")])
def test_an_exception_ends_the_run_and_goes_on_up(mirror, exc, state):
    with pytest.raises(exc):
        with mirror.run("step", {}) as run:
            raise exc()
    assert _status(mirror, run.id) == state


def test_a_resumed_run_is_reopened_not_duplicated(mirror):
    with mirror.run("folder", {}) as first:
        first.state = "FAILED"
    with mirror.run("folder", {}, resume=first.id) as again:
        pass
    assert again.id == first.id and _status(mirror, first.id) == "FINISHED"
    with mirror.run("folder", {}, resume="0" * 32) as fresh:  # a run this store does not have: a new one
        pass
    assert fresh.id != first.id


def test_no_tracking_takes_the_same_calls_and_keeps_nothing():
    with NoTracking().run("step", {}) as run:
        run.log(metrics={"x": 1.0})
    assert run.id is None and NoTracking().end_stale("tag", "value") == []


@pytest.mark.parametrize("command", [["single"], ["sweep", "-m", "seed=1,2"]])
def test_a_tracking_server_that_never_answers_is_refused_in_seconds_before_anything_runs(command, tmp_path, capsys):
    """A loopback socket that accepts and never replies: MLflow alone would retry for minutes, in silence."""
    import socket
    import time
    from pathlib import Path

    from runner.cli import main

    manifest = Path(__file__).resolve().parents[2] / "manifests" / "tiny.yaml"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel accepts connections; nobody ever reads or answers them
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        started = time.perf_counter()
        code = main([str(manifest), *command[1:], f"tracking.tracking_uri={uri}",
                     f"tracking.runs_dir={tmp_path / 'r'}"])
        elapsed = time.perf_counter() - started
    assert code == 2 and elapsed < 30
    assert capsys.readouterr().err.splitlines() == [
        f"error: tracking.tracking_uri: the MLflow server at {uri} does not answer (no answer within 5 s): start it "
        "(mlflow server --host HOST --port PORT), or set tracking.mlflow=false, or leave tracking.tracking_uri out to "
        "keep runs in <runs_dir>/mlflow.db (a local store); nothing ran"]
    assert not (tmp_path / "r").exists(), "no run folder, no store: nothing was started"


def test_run_results_on_a_server_nobody_runs_says_so_at_once(capsys):
    import socket

    from runner.cli import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: refused
        assert main(["results", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --tracking-uri: the MLflow server at {uri} does not answer (Connection refused): start it "
        "(mlflow server --host HOST --port PORT), or leave --tracking-uri out to read <runs-dir>/mlflow.db"]


@pytest.mark.e2e
def test_a_tracking_server_that_hangs_mid_run_loses_the_mirror_not_the_run(tmp_path):
    """A real MLflow server, stopped (SIGSTOP) while the first step runs: its calls time out, the error is said once,
    every step still runs and finishes in the run folder, and the exit status is that of the steps."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.conftest import tiny_manifest

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--serve-artifacts",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        runs = """      - id: first
        mode: generate
        generate: {prompts: ["x"], max_new_tokens: 800, max_seq_len: 1000, temperature: 0, eos_token_id: []}
      - id: second
        mode: generate
        generate: {prompts: ["y"], max_new_tokens: 2}
"""
        path = tiny_manifest(tmp_path, runs)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2",
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "runner", str(path), f"tracking.tracking_uri={uri}"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        status_file = None
        while time.time() < deadline and proc.poll() is None:
            found = list((tmp_path / "runs").glob("*/status.json"))
            if found and '"tiny/first"' in found[0].read_text():
                status_file = found[0]
                os.killpg(server.pid, signal.SIGSTOP)  # it keeps its sockets: calls connect, then hear nothing
                break
            time.sleep(0.1)
        _, err = proc.communicate(timeout=300)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert status_file is not None, "the first step never started"
    assert proc.returncode == 0, err
    assert err.count(f"MLflow at {uri} failed while") == 1, err
    status = json.loads(status_file.read_text())
    assert status["state"] == "finished"
    assert [status["steps"][k]["state"] for k in ("tiny/first", "tiny/second")] == ["finished", "finished"]
    assert (status_file.parent / "tiny" / "second" / "results.json").is_file()
