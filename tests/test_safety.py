"""Security and faults: no shell anywhere, remote code only when asked and then loudly, write failures are
clear and lose nothing, an interrupted bench keeps the cells it measured."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.errors import ResourceError
from runner.execute.tracking import RunFolder
from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

PACKAGE = Path(__file__).resolve().parents[1] / "runner"
SHELL = re.compile(r"shell\s*=\s*True|os\.system\(|os\.popen\(|(?<![.\w])eval\(|(?<![.\w])exec\(|"
                   r"yaml\.load\(|yaml\.unsafe_load|Loader\s*=\s*yaml\.(Full|Unsafe)?Loader\b")


def test_no_shell_eval_or_unsafe_yaml_in_the_package():
    offenders = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
                 for path in PACKAGE.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if SHELL.search(line)]
    assert offenders == []


@pytest.mark.e2e
def test_remote_code_is_off_unless_asked_and_loud_when_on(tmp_path):
    runs = """      - id: g
        mode: generate
        generate: {prompts: ["hi"], max_new_tokens: 2}
"""
    quiet = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", cwd=tmp_path)
    loud = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", "targets.0.model.trust_remote_code=true",
                   cwd=tmp_path)
    assert quiet.returncode == 0 and loud.returncode == 0, loud.stderr
    assert "trust_remote_code" not in quiet.stderr
    assert "WARNING: trust_remote_code is ON for config model" in loud.stderr


def test_a_write_that_fails_is_a_clear_error_and_leaves_no_temporary_file(tmp_path):
    folder = RunFolder.create(tmp_path, "w")
    (folder.path / "results.json").mkdir()  # the target cannot be replaced by a file
    with pytest.raises(ResourceError, match=r"cannot write .*results\.json: .*\(disk full or not writable\?\)"):
        folder.write_json("results.json", {"a": 1})
    assert not list(folder.path.glob("*.tmp"))


@pytest.mark.e2e
def test_an_unusable_runs_dir_fails_before_any_work(tmp_path):
    (tmp_path / "blocker").write_text("a file where the runs folder should be")
    runs = """      - id: g
        mode: generate
"""
    done = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", f"tracking.runs_dir={tmp_path}/blocker/runs",
                   cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot create the run folder under" in done.stderr and "loading" not in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.e2e
def test_an_interrupted_bench_keeps_its_measured_cells(tmp_path, sig):
    runs = """      - id: matrix
        mode: bench
        bench: {batch_sizes: 1, prompt_lens: [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
                max_new_tokens: 200, repeats: 3, baseline: hf, roofline: false}
"""
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(tiny_manifest(tmp_path, runs))], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    table_path = None
    deadline = time.time() + 300
    while time.time() < deadline and table_path is None:
        time.sleep(0.5)
        found = list((tmp_path / "runs").glob("*-t/tiny/matrix/bench.csv"))
        table_path = found[0] if found else None
    assert table_path is not None, "no cell finished in time"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err
    table = pd.read_csv(table_path)
    assert 1 <= len(table) < 16 and (table["status"] == "ok").all()
    status = json.loads((table_path.parents[2] / "status.json").read_text())
    assert status["state"] == "interrupted" and status["steps"]["tiny/matrix"]["state"] == "interrupted"
