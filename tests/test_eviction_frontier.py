"""benchmarks/eviction_frontier.py --quick on the zoo's SmolLM2-135M: part 1 (ours against kvpress, per press) and
the frontier are measured and printed, and their CSVs and plot written. Scores and speed are not checked; the
kept-set overlap is (knorm keeps by key norm alone, so ours and kvpress's must keep nearly the same tokens)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The data rows of the markdown table whose header starts with `header_start`, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.e2e
def test_quick_run_compares_with_kvpress_and_prints_the_frontier(tmp_path):
    from runner.errors import ModelError
    from runner.infer.loading.peers import kvpress_site
    from runner.infer.loading.zoo import zoo_cached

    if not zoo_cached("zoo:smollm2-135m"):
        pytest.skip("zoo:smollm2-135m is not converted in runner's cache (load it once with runner first)")
    try:
        kvpress_site()
    except ModelError as exc:  # PyPI not reachable: nothing to compare with
        pytest.skip(f"the kvpress site cannot be made here: {exc}")

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # as docs/performance.md says
    env.pop("PYTHONPATH", None)
    command = [sys.executable, str(ROOT / "benchmarks" / "eviction_frontier.py"), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    compare = table_rows(done.stdout, "| press |")
    assert [r[0] for r in compare] == ["knorm / knorm", "snapkv / snapkv"]
    with (tmp_path / "compare.csv").open() as f:
        knorm = next(csv.DictReader(f))
    assert float(knorm["kept Jaccard"]) > 0.95, knorm  # one token apart at most per head (ceil vs int)

    frontier = table_rows(done.stdout, "| family |")
    assert {r[0] for r in frontier} == {"reference", "quantization", "eviction", "both"}
    assert "target:" in done.stdout
    for name in ("compare.csv", "frontier.csv", "samples.csv", "frontier.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with (tmp_path / "frontier.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[0]["bytes_vs_fp16"]) == 1.0 and rows[0]["kind"] == "fp16"

    # a rerun of the same setup answers nothing of ours again: it reads samples.csv and gives the same frontier
    ours_rows = sum(r["side"] == "ours" for r in csv.DictReader((tmp_path / "samples.csv").open()))
    again = subprocess.run(command + ["--skip-kvpress"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming: {ours_rows} answers of ours" in again.stdout
    assert sum(r["side"] == "ours" for r in csv.DictReader((tmp_path / "samples.csv").open())) == ours_rows
    assert table_rows(again.stdout, "| family |") == frontier
