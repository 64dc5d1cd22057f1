"""benchmarks/gpu_suite.sh --smoke: the GPU suite's every step on CPU with a tiny random model, so its plumbing
(arguments, model sources, the one markdown table) is checked where no GPU is lent. Speed is not checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the suite's markdown table, as cells."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]  # the first is the header


@pytest.mark.compile  # compiles a tiny model's steps: about a minute on 2 cores
def test_smoke_suite_fills_one_table_with_every_benchmark(tmp_path):
    out = tmp_path / "suite.md"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--smoke", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text(encoding="utf-8")
    assert text.startswith("GPU suite (smoke, CPU):")
    rows = table_rows(text)
    decode = {(r[3], r[5]): r for r in rows if r[0] == "decode"}
    assert set(decode) == {(b, v) for b in ("1", "2") for v in ("compiled", "hf", "hf-compiled")}
    assert all(float(r[6]) > 0 for r in rows)  # decode tok/s
    assert all(r[12] == "True" for r in decode.values())  # fp32 greedy: the same tokens as transformers
    assert all(float(r[8]) == 1.0 for (_, v), r in decode.items() if v == "hf")  # ÷hf of hf itself
    kinds = {r[5]: float(r[10]) for r in rows if r[0] == "cache kinds"}
    assert set(kinds) == {"compiled fp16", "compiled q8_0"} and kinds["compiled fp16"] == 1.0
    spec = [r for r in rows if r[0] == "speculative"]
    assert {r[5] for r in spec} >= {"ours target-only (k=4)", "ours spec batched (k=4)", "hf generate"}
    assert all(r[12] == "True" for r in spec)  # greedy speculation is exact
