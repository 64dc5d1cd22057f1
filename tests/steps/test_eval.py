"""`mode: eval` end to end on the tiny model: every task × length × cache kind scored on the same samples, the
bytes each kind holds against the reference's, the tables, the plot and the metrics."""

import json

import pandas as pd
import pytest

from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

EVAL = """      - id: tasks
        mode: eval
        eval:
          tasks: [niah_single_1, niah_multikey_2]
          lengths: [600]
          samples: 2
          cache_kinds: [fp32+snapkv:0.5, q8_0, q8_0+tova:0.5]
"""


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    done = run_cli(tiny_manifest(tmp, EVAL), cwd=tmp)
    return done, next((tmp / "runs").glob("*-t")) / "tiny" / "tasks"


@pytest.mark.e2e
def test_every_kind_is_scored_on_the_same_samples_with_its_bytes(eval_run):
    done, step = eval_run
    assert done.returncode == 0, done.stderr
    scores = pd.read_csv(step / "eval_scores.csv")
    assert len(scores) == 2 * 1 * 4  # tasks × lengths × (reference + 3 kinds)
    assert list(dict.fromkeys(scores["cache_kind"])) == ["fp32", "fp32+snapkv:0.5", "q8_0", "q8_0+tova:0.5"]
    assert (scores["n"] == 2).all() and (scores["low"] <= scores["score"]).all()
    ratio = scores.groupby("cache_kind")["bytes_ratio"].mean()
    assert ratio["fp32"] == 1
    assert ratio["q8_0"] == pytest.approx(34 / 64)  # head_dim 16: one 32-channel block (32 codes + a 2-byte scale)
    answers = pd.read_csv(step / "eval_answers.csv")
    assert len(answers) == 2 * 2 * 4 and (answers["prompt_tokens"] <= 600).all()
    kept = answers[answers["cache_kind"] == "fp32+snapkv:0.5"]["prompt_tokens"].apply(lambda t: -(-t // 2) / t)
    assert ratio["fp32+snapkv:0.5"] == pytest.approx(kept.mean(), rel=1e-3)  # ceil(T/2) of T tokens held
    # the two evicting kinds shared one prompt forward a sample (tasks.evaluate_kinds); each stored its own
    assert ratio["q8_0+tova:0.5"] == pytest.approx(kept.mean() * 34 / 64, rel=1e-3)
    samples = answers.groupby(["task", "index"])["prompt_tokens"].nunique()
    assert (samples == 1).all(), "every kind read the same prompts"


@pytest.mark.e2e
def test_the_frontier_is_plotted_and_the_summary_and_metrics_are_in_results(eval_run):
    done, step = eval_run
    assert (step / "eval_frontier.png").stat().st_size > 1000
    results = json.loads((step / "results.json").read_text())
    metrics = results["metrics"]
    assert metrics["fp32_with_snapkv:0.5_600.bytes_ratio"] < 0.6 and metrics["fp32_600.bytes_ratio"] == 1
    assert {row["cache_kind"] for row in results["summary"]} == {"fp32", "q8_0", "fp32+snapkv:0.5", "q8_0+tova:0.5"}
    assert "long-context tasks" in done.stdout
