import pytest

from runner.infer.tasks.scoring import (
    Interval,
    TaskScore,
    drop_beyond_noise,
    informative,
    interval,
    score,
    string_match_all,
    string_match_part,
    task_score,
    wilson,
)


def test_string_match_all_counts_the_references_found_case_insensitively():
    assert string_match_all(" The numbers are 123 and ABC-def.", ["123", "abc-DEF", "999", "7"]) == 0.5
    assert string_match_all("\x00 1234567 \n", ["1234567"]) == 1.0
    assert string_match_all("", ["1"]) == 0.0


def test_string_match_part_is_any():
    assert string_match_part("it is Paris", ["London", "paris"]) == 1.0
    assert string_match_part("it is Rome", ["London", "paris"]) == 0.0


def test_task_scores_are_rulers_means_times_100():
    preds = ["a b c d", "a", "nothing", "A B"]
    refs = [["a", "b", "c", "d"], ["a", "b"], ["x"], ["a", "b", "z", "y"]]
    assert task_score("string_match_all", preds, refs) == pytest.approx(100 * (1 + 0.5 + 0 + 0.5) / 4)  # 50.0
    assert task_score("string_match_part", preds, refs) == 75.0
    with pytest.raises(ValueError, match="unknown metric"):
        score("exact", "a", ["a"])
    with pytest.raises(ValueError, match="one reference list per prediction"):
        task_score("string_match_all", ["a"], [])


def test_wilson_known_values_and_edges():
    assert wilson(2, 5) == pytest.approx((0.117621, 0.769276), abs=1e-6)
    assert wilson(5, 5)[1] == 1.0 and wilson(5, 5)[0] == pytest.approx(0.565518, abs=1e-6)
    assert wilson(0, 5)[0] == 0.0 and wilson(0, 5)[1] == pytest.approx(0.434482, abs=1e-6)
    assert wilson(1, 1) == pytest.approx((0.206549, 1.0), abs=1e-6)


def test_intervals_hold_the_mean_and_pick_their_method():
    right = interval([1, 1, 1, 1, 1])
    assert right.method == "wilson" and right.high == 100 and right.low == pytest.approx(56.55, abs=0.01)
    wrong = interval([0, 0, 0])
    assert wrong.low == 0 and 0 < wrong.high < 100
    one = interval([0.5])
    assert one.method == "wilson" and one.low < 50 < one.high
    frac = interval([0.75, 0.5, 1.0, 0.25])  # mean .625, sd .3227, t(3) = 3.1824
    assert frac.method == "t" and (frac.low, frac.high) == pytest.approx((11.14, 100.0), abs=0.01)
    flat = interval([0.75] * 4)
    assert flat.method == "wilson" and flat.low < 75 < flat.high
    with pytest.raises(ValueError):
        interval([])
    with pytest.raises(ValueError):
        interval([1.5])


def test_informative_needs_the_interval_above_the_floor_and_drops_within_it_are_not_drops():
    assert TaskScore.of("t", 1024, [1, 1, 0, 0, 0]).informative  # 40, low 11.8
    assert not TaskScore.of("t", 1024, [1, 0, 0, 0, 0]).informative  # 20, low 3.6
    assert not informative(60.0, (5.0, 90.0)) and informative(60.0, Interval(20.0, 90.0, "t"))
    base = TaskScore.of("t", 1024, [1] * 5)  # low 56.55
    assert drop_beyond_noise(base, TaskScore.of("t", 1024, [1, 1, 1, 0, 0])) == 0.0  # 60: within
    assert drop_beyond_noise(base, TaskScore.of("t", 1024, [1, 0, 0, 0, 0])) == pytest.approx(56.55 - 20, abs=0.01)
