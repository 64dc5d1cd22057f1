"""Eight processes choosing cache kinds at once, sharing one cache-plan file and one MLflow store."""

import json
import os
import subprocess
import sys

import pytest

from runner.infer.select.cache_plans import CachePlanStore
from tests.conftest import TINY_LLAMA

PROCESSES = 8


def manifest(tmp_path, i: int):
    path = tmp_path / f"m{i}.yaml"
    path.write_text(f"""name: c{i}
tracking: {{mlflow: true, runs_dir: runs, experiment: shared}}
targets:
  - name: tiny
    model: {{config: {TINY_LLAMA}, device: cpu}}
    runs:
      - id: pick
        mode: auto-cache-select
        generate: {{batch_size: {i + 1}, max_seq_len: 256, cache_candidates: [fp16, q8_0], cache_quality_windows: 1,
                   cache_quality_ppl_len: 128, cache_quality_prompt_len: 16, cache_quality_decode_steps: 2,
                   cache_auto_bench_repeats: 1, cache_auto_bench_steps: 2, cache_plan_path: plans/shared.json}}
""")
    return path


@pytest.mark.e2e
def test_eight_concurrent_selections_leave_every_plan_and_run_intact(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "runner", str(manifest(tmp_path, i))], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PROCESSES)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        assert "Traceback" not in err

    plans = json.loads((tmp_path / "plans" / "shared.json").read_text())  # valid JSON
    assert len(plans["plans"]) == PROCESSES  # one per batch size: no writer lost another's cache plan
    store = CachePlanStore(tmp_path / "plans" / "shared.json")
    for key in plans["plans"]:
        assert store.get(key)["kind"] in ("fp16", "q8_0")
    assert not list((tmp_path / "plans").glob("*.tmp")) and not list((tmp_path / "plans").glob("*.corrupt-*"))

    folders = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name != "mlartifacts"]
    assert len(folders) == PROCESSES
    for folder in folders:
        assert json.loads((folder / "status.json").read_text())["state"] == "finished"

    from runner.execute.results import Store

    runs = Store(None, str(tmp_path / "runs")).runs("shared")
    assert len(runs) == 2 * PROCESSES and {r.info.status for r in runs} == {"FINISHED"}
