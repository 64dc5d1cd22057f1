"""`mode: eval` end to end on the tiny model: every task × length × cache kind scored on the same samples, the
bytes each kind holds against the reference's, the tables, the plot and the metrics; a step killed mid-way and
resumed answers only the samples its journal lacks."""

import json
import signal
import time

import pandas as pd
import pytest

from runner.files import append_json_line, read_json_lines
from runner.infer.loading.models import byte_tokenizer
from runner.infer.tasks.evaluate import SampleResult, sample_key
from runner.infer.tasks.ruler import make_samples
from runner.steps.eval import JOURNAL, Journal
from tests.conftest import tiny_manifest
from tests.execute.test_resume import _start
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


def test_the_journal_gives_back_this_steps_answers_for_the_same_kinds_only(tmp_path):
    samples = make_samples("niah_single_1", byte_tokenizer(), 600, 2, seed=0)
    by_key = {sample_key(s): s for s in samples}
    result = SampleResult(samples[1], "7", 1.0, 590, 2, "eos", 0.5, 0.25, 4096)
    Journal(tmp_path / JOURNAL, "hash-a", by_key).add(["fp32"], samples[1], [result])
    append_json_line(tmp_path / JOURNAL, {"hash": "hash-b", "kinds": ["fp32"], "task": "niah_single_1",
                                          "length": 600, "index": 0, "results": [result.record()]})
    again = Journal(tmp_path / JOURNAL, "hash-a", by_key)
    assert again.answered(["fp32"]) == {sample_key(samples[1]): [result]}  # hash-b's line is another step's
    assert again.answered(["q8_0"]) == {}
    assert Journal(tmp_path / JOURNAL, "hash-c", by_key).answered(["fp32"]) == {}


RESUMABLE = """      - id: tasks
        mode: eval
        eval: {tasks: [niah_single_1], lengths: [600], samples: 12, cache_kinds: [q8_0]}
"""


@pytest.mark.e2e
def test_a_killed_eval_resumes_answering_only_what_its_journal_lacks(tmp_path):
    path = tiny_manifest(tmp_path, RESUMABLE)
    proc = _start(path, cwd=tmp_path)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        journals = list((tmp_path / "runs").glob(f"*-t/tiny/tasks/{JOURNAL}"))
        if journals and len(read_json_lines(journals[0])) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -9, "the step ended before 3 of its 24 samples were journaled"
    kept = len(read_json_lines(journals[0]))
    assert 3 <= kept < 24

    done = run_cli(path, "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"fp32: {min(kept, 12)} of 12 samples answered by an earlier attempt" in done.stderr
    lines = read_json_lines(journals[0])
    assert len(lines) == 24 and len({(r["kinds"][0], r["index"]) for r in lines}) == 24  # none answered twice

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert run_cli(tiny_manifest(fresh, RESUMABLE), cwd=fresh).returncode == 0
    resumed = pd.read_csv(journals[0].parent / "eval_answers.csv")
    whole = pd.read_csv(next((fresh / "runs").glob("*-t")) / "tiny" / "tasks" / "eval_answers.csv")
    columns = ["task", "length", "index", "cache_kind", "score", "prediction", "new_tokens"]
    pd.testing.assert_frame_equal(resumed[columns], whole[columns])
