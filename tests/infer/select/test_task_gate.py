"""The task gate: its rule on hand-made scores (a drop within the reference's interval is not a drop; tasks the
reference cannot do gate nothing), and its place in cache selection on the tiny model."""

import math

import pytest

from runner.infer.config.tasks import TaskGates
from runner.infer.select.task_gate import verdict
from runner.infer.tasks.scoring import TaskScore
from tests.infer.select.test_autocache import _config, _select


def _scores(**right_of_five: int) -> dict:
    """task name → a score at 1024 tokens with that many of 5 samples right."""
    return {(name, 1024): TaskScore.of(name, 1024, [1.0] * k + [0.0] * (5 - k)) for name, k in right_of_five.items()}


def test_a_drop_below_the_references_interval_fails_by_the_points_beyond_it():
    reference = _scores(niah_single_1=5)  # 100, Wilson 95 % low bound 56.55
    figures, failures = verdict(reference, _scores(niah_single_1=2), TaskGates(max_drop=2))
    assert figures["task_drop"] == pytest.approx(reference[("niah_single_1", 1024)].interval.low - 40)
    assert figures["task_score"] == 40 and figures["task_reference"] == 100 and figures["task_pairs"] == 1
    assert failures == [f"task drop {figures['task_drop']:.1f} > 2"]


def test_a_drop_within_the_interval_is_not_a_drop():
    figures, failures = verdict(_scores(niah_single_1=5), _scores(niah_single_1=3), TaskGates(max_drop=2))
    assert figures["task_drop"] == 0 and failures == []  # 60 lies inside [56.6, 100]


def test_tasks_the_reference_cannot_do_do_not_gate():
    figures, failures = verdict(_scores(vt=1, cwe=0), _scores(vt=0, cwe=0), TaskGates(tasks=["vt", "cwe"]))
    assert failures == [] and figures["task_pairs"] == 0 and figures["task_uninformative"] == 2
    assert math.isnan(figures["task_drop"])


def test_per_task_names_each_failing_task_and_the_average_can_pass_where_it_would_not():
    reference, candidate = _scores(vt=5, cwe=5), _scores(vt=2, cwe=5)
    gates = TaskGates(tasks=["vt", "cwe"], max_drop=10)
    _, average = verdict(reference, candidate, gates)
    _, each = verdict(reference, candidate, gates.model_copy(update={"per_task": True}))
    assert average == [] and len(each) == 1 and each[0].startswith("vt@1024 drop 16.")


def test_selection_runs_the_gate_on_the_cheap_gates_survivors_and_records_its_figures(tmp_path, tiny_lm):
    gates = {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1}
    selection = _select(tiny_lm, _config(tmp_path, cache_candidates=["q8_0", "fp32+knorm:0.5"], max_seq_len=1024,
                                         cache_quality_max_delta_nll=100, cache_quality_max_ppl_ratio=100,
                                         cache_quality_max_mean_kl=100, cache_quality_tasks=gates))
    rows = {row["kind"]: row for row in selection.rows}
    assert set(rows) == {"q8_0", "fp32+knorm:0.5"}
    for row in rows.values():  # a random model finds no needle: nothing informative, so the gate passes all
        assert row["task_pairs"] == 0 and row["task_uninformative"] == 1 and row["task_samples"] == 1
        assert row["passed"], row["verdict"]


def test_joint_selection_judges_each_weights_candidates_kinds_together(tmp_path, tiny_lm):
    """weight_candidates: each weights' cheap-gate survivors go through the task gate in one call (their evicting
    kinds share a prompt forward a sample), and every surviving row carries its task figures."""
    from tests.infer.select.test_joint import _config as joint_config
    from tests.infer.select.test_joint import _select as joint_select

    gates = {"tasks": ["niah_single_1"], "lengths": [512], "samples": 1}
    selection = joint_select(tiny_lm, joint_config(
        tmp_path, weight_candidates=["none", "int8"], cache_candidates=["fp32+knorm:0.5", "q8_0+tova:0.5"],
        max_seq_len=1024, cache_quality_max_delta_nll=100, cache_quality_max_ppl_ratio=100,
        cache_quality_max_mean_kl=100, cache_quality_tasks=gates, cache_auto_benchmark=False))
    judged = [row for row in selection.rows if "task_samples" in row]
    assert {(row["weights"], row["kind"]) for row in judged} == {
        (w, k) for w in ("none", "int8") for k in ("fp32+knorm:0.5", "q8_0+tova:0.5")}
    assert all(row["passed"] and row["task_samples"] == 1 for row in judged)
