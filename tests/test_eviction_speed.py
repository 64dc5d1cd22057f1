"""benchmarks/eviction_speed.py on a tiny model of a shape from benchmarks/shapes/: a row per context and kind, the
first kind the baseline of every ratio, and the cache bytes an evicting kind holds as its ratio says."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_every_kind_gets_a_row_with_ratios_to_the_first():
    command = [sys.executable, str(ROOT / "benchmarks" / "eviction_speed.py"), "--model",
               "benchmarks/shapes/tiny-qwen2.json", "--context", "256", "--kinds", "fp32", "fp32+snapkv:0.5",
               "q8_0+knorm:0.75", "--decode", "4", "--repeats", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in done.stdout.splitlines() if line.strip().startswith("256 ")}
    assert list(rows) == ["fp32", "fp32+snapkv:0.5", "q8_0+knorm:0.75"]
    assert rows["fp32"][4] == "1.00" and rows["fp32"][-1] == "1.000"
    assert float(rows["fp32+snapkv:0.5"][-1]) == pytest.approx((128 + 4) / (256 + 4), abs=0.001)  # half kept, 4 new
