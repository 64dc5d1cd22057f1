"""benchmarks/serve_targets.py --quick on the tiny random model: every target's row is measured and printed (its
plumbing: loads, servers, the SLO, the estimator), so the script keeps running where no real model is. Speed and
pass/fail are not checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the script's markdown table, as cells."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # the first is the header


@pytest.mark.e2e
def test_quick_run_prints_every_target():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # run as docs/performance.md says: no PYTHONPATH
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_targets.py"), "--model", "tiny", "--quick",
               "--skip-transformers", "--threads", "1"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = table_rows(done.stdout)
    targets = [r[0] for r in rows]
    assert sum(t.startswith("1. continuous ÷ static") for t in targets) == 2
    assert any(t.startswith("2. ours ÷ transformers") and r[3] == "n/a" for t, r in zip(targets, rows))
    admitted = [r for r in rows if r[0].startswith("3.") and "estimator" in r[0]]
    assert [r[0].split(":")[0] for r in admitted] == ["3. fp16", "3. q8_0", "3. q4_0", "3. kivi4"]
    assert all(r[3] == "pass" for r in admitted)  # the scheduler admits what the estimator says, exactly
    assert sum(t.startswith("4. scheduler") for t in targets) == 2


@pytest.mark.e2e
@pytest.mark.compile
def test_quick_budget_on_the_compiled_slots():
    """Target 3 with --engine compiled: the budgeted runs on CompiledSlots admit what the estimator says, kivi4
    included; KIVI with sinks, which the slots refuse, is named as not run rather than measured on another engine."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "serve_targets.py"), "--model", "tiny", "--quick",
               "--engine", "compiled", "--targets", "3", "--budget-running", "16", "--threads", "1",
               "--kinds", "q8_0", "kivi4", "kivi2:s2"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    admitted = [r for r in table_rows(done.stdout) if r[0].startswith("3.") and "estimator" in r[0]]
    assert [r[0].split(":")[0] for r in admitted] == ["3. fp16", "3. q8_0", "3. kivi4"]
    assert all(r[3] == "pass" for r in admitted)
    assert "kivi2:s2 not run on the compiled slots: KIVI with sinks (s2)" in done.stdout
