"""The `run` command in a subprocess, as a user types it: exit codes, messages, run folder, MLflow."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import tiny_manifest

RUNS = """      - id: greedy
        mode: generate
        generate: {prompts: ["hello", "a longer prompt"], batch_size: 2, max_new_tokens: 6, temperature: 0}
      - id: sampled
        mode: generate
        generate: {prompts: ["hi"], max_new_tokens: 5, temperature: 0.9, top_k: 20, stream: true}
"""


def run_cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "runner", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def test_check_imports_no_torch(tmp_path):
    """`run check` stays cheap by never importing torch (or transformers); no wall-clock bound: machines are shared."""
    path = tiny_manifest(tmp_path, RUNS)
    code = ("import sys; from runner.cli import main; "
            f"rc = main(['check', {str(path)!r}]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[]"


@pytest.mark.e2e
def test_bad_manifest_exits_2_with_a_located_message_and_no_traceback(tmp_path):
    path = tiny_manifest(tmp_path, RUNS.replace("max_new_tokens: 6", "max_new_tokenz: 6"))
    for command in (["check"], ["plan"], []):
        done = run_cli(*command, path)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert f"{path}:" in done.stderr and "did you mean 'max_new_tokens'?" in done.stderr


@pytest.mark.e2e
def test_usage_errors_exit_2(tmp_path):
    done = run_cli()
    assert done.returncode == 2 and "manifest" in done.stderr


@pytest.mark.e2e
def test_schema_prints_json_schema():
    done = run_cli("schema")
    assert done.returncode == 0
    assert json.loads(done.stdout)["title"] == "Manifest"


@pytest.mark.e2e
def test_run_writes_the_run_folder_and_mlflow(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    done = run_cli(path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    for name in ("manifest.resolved.yaml", "plan.json", "env.json", "status.json"):
        assert (folder / name).is_file()
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "finished"
    assert {k: v["state"] for k, v in status["steps"].items()} == {"tiny/greedy": "finished",
                                                                   "tiny/sampled": "finished"}
    result = json.loads((folder / "tiny" / "greedy" / "results.json").read_text())
    assert [r["new_tokens"] for r in result["prompts"]] == [6, 6]
    assert result["model"]["n_params"] > 0 and result["metrics"]["new_tokens"] == 12
    env = json.loads((folder / "env.json").read_text())
    assert {"python", "torch", "transformers", "cpu", "git_sha"} <= set(env)
    streamed = json.loads((folder / "tiny" / "sampled" / "results.json").read_text())["prompts"][0]
    assert streamed["prompt"] + streamed["output"] in done.stdout  # printed as it was generated

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    runs = client.search_runs([experiment.experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    assert sorted(r.info.run_name for r in children) == ["tiny/greedy", "tiny/sampled"]
    greedy = next(r for r in children if r.info.run_name == "tiny/greedy")
    assert greedy.data.params["generate.max_new_tokens"] == "6" and greedy.data.metrics["new_tokens"] == 12
    artifacts = [a.path for a in client.list_artifacts(greedy.info.run_id)]
    assert "results.json" in artifacts


@pytest.mark.e2e
def test_greedy_rerun_of_the_resolved_manifest_gives_identical_tokens(tmp_path):
    path = tiny_manifest(tmp_path, RUNS, extra="")
    assert run_cli(path, "tracking.mlflow=false", cwd=tmp_path).returncode == 0
    (first,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    resolved = first / "manifest.resolved.yaml"
    time.sleep(1.1)  # a new UTC stamp for the second folder
    assert run_cli(resolved, cwd=tmp_path).returncode == 0
    second = max(p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p != first)
    for run in ("greedy", "sampled"):
        a, b = (json.loads((f / "tiny" / run / "results.json").read_text()) for f in (first, second))
        assert [r["token_ids"] for r in a["prompts"]] == [r["token_ids"] for r in b["prompts"]]


@pytest.mark.e2e
def test_a_failing_step_is_recorded_and_the_others_run(tmp_path):
    runs = RUNS.replace('generate: {prompts: ["hi"]', 'generate: {prompts: ["far too long"], max_seq_len: 3')
    path = tiny_manifest(tmp_path, runs)
    done = run_cli(path, "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "does not fit max_seq_len=3" in done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    status = json.loads((folder / "status.json").read_text())
    assert status["steps"]["tiny/greedy"]["state"] == "finished"
    assert status["steps"]["tiny/sampled"]["state"] == "failed" and status["state"] == "failed"


@pytest.mark.e2e
def test_unknown_local_model_is_a_clear_error(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    text = path.read_text().replace("    model:\n", "    model:\n      id: ./no-such-model\n      x_removed: 1\n")
    text = "\n".join(line for line in text.splitlines() if "config:" not in line and "x_removed" not in line)
    path.write_text(text + "\n")
    done = run_cli(path, "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"model path './no-such-model' does not exist (looked for {tmp_path / 'no-such-model'})" in done.stderr


@pytest.mark.e2e
def test_interrupt_marks_the_run_folder_and_mlflow_and_keeps_finished_steps(tmp_path):
    runs = RUNS.split("      - id: sampled")[0] + """      - id: long
        mode: generate
        generate: {prompts: ["x"], max_new_tokens: 100000, max_seq_len: 200000, temperature: 1.0, eos_token_id: []}
      - id: after
        mode: generate
        generate: {prompts: ["x"], max_new_tokens: 2}
"""
    path = tiny_manifest(tmp_path, runs)
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 120
    status_files = []
    while time.time() < deadline:
        status_files = list((tmp_path / "runs").glob("*/status.json"))
        if status_files and '"tiny/long"' in status_files[0].read_text():
            break
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    status = json.loads(status_files[0].read_text())
    assert status["state"] == "interrupted"
    assert status["steps"]["tiny/greedy"]["state"] == "finished"
    assert status["steps"]["tiny/long"]["state"] == "interrupted"
    after = status["steps"]["tiny/after"]
    assert (after["state"], after["reason"]) == ("skipped", "not run: tiny/long interrupted")
    assert (status_files[0].parent / "tiny" / "greedy" / "results.json").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs_by_name = {r.info.run_name: r.info.status
                    for r in client.search_runs([client.get_experiment_by_name("t").experiment_id])}
    assert runs_by_name == {"t": "KILLED", "tiny/greedy": "FINISHED", "tiny/long": "KILLED"}


@pytest.mark.e2e
def test_on_failure_stop_skips_the_steps_after_a_failure(tmp_path):
    runs = RUNS.replace('generate: {prompts: ["hello", "a longer prompt"]', 'generate: {prompts: ["far too long"], '
                        'max_seq_len: 3')
    path = tiny_manifest(tmp_path, runs, extra="on_failure: stop")
    done = run_cli(path, "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "skipped (on_failure: stop): tiny/sampled" in done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    status = json.loads((folder / "status.json").read_text())
    assert {k: v["state"] for k, v in status["steps"].items()} == {"tiny/greedy": "failed", "tiny/sampled": "skipped"}
    assert not (folder / "tiny" / "sampled").exists()


def test_a_ctrl_c_inside_a_constructor_ends_without_a_traceback(monkeypatch, capfd):
    """A Ctrl-C can land in a progress bar's __init__; the half-built bar's __del__ then fails when collected."""
    import gc

    from runner import cli

    class HalfBuilt:
        def __del__(self):
            raise AttributeError("'HalfBuilt' object has no attribute 'pos'")

    def interrupted_while_building(command, argv):
        bar = HalfBuilt()  # noqa: F841  (alive in the traceback until main has handled the interrupt)
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own, as in `run`; restored after
    monkeypatch.setattr(cli, "_dispatch", interrupted_while_building)
    assert cli.main(["tiny.yaml"]) == 130
    gc.collect()
    err = capfd.readouterr().err
    assert "interrupted:" in err and "Traceback" not in err and "HalfBuilt" not in err


@pytest.mark.e2e
def test_a_cache_folder_that_is_a_file_fails_the_step_that_needs_it_and_the_others_run(tmp_path):
    """RUNNER_CACHE names a file: the selection that must download its evaluation text into the cache fails with
    the reason (no traceback), the generate step after it still finishes (its kernels and inductor caches are only
    warnings), and the exit status is the failure policy's: 2."""
    runs = """      - id: select
        mode: auto-cache-select
        generate: {cache_candidates: [q8_0], cache_quality_data: shakespeare}
""" + RUNS.split("      - id: sampled")[0]
    path = tiny_manifest(tmp_path, runs)
    (tmp_path / "cache").write_text("not a folder")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUNNER_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "runner", str(path), "tracking.mlflow=false"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    reason = (f"cannot write {tmp_path}/cache/data in runner's cache folder {tmp_path}/cache: {tmp_path}/cache is a "
              "file, not a folder; set RUNNER_CACHE to a writable folder")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"step tiny/select failed: {reason}" in done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    status = json.loads((folder / "status.json").read_text())
    assert status["steps"]["tiny/select"] == {**status["steps"]["tiny/select"], "state": "failed", "error": reason}
    assert status["steps"]["tiny/greedy"]["state"] == "finished" and status["state"] == "failed"
