"""The task settings the manifest checks without torch: names, lengths, the gate's bounds, items located."""

import pytest
from pydantic import ValidationError

from runner.errors import ValueAt
from runner.infer.config.tasks import TASK_NAMES, TaskGates, TaskSuite, task_problem
from runner.infer.tasks.ruler import TASKS


def test_the_manifest_knows_exactly_the_tasks_the_suite_builds():
    assert TASK_NAMES == tuple(TASKS)


def test_a_misspelt_task_names_the_closest_and_a_known_one_passes():
    assert task_problem("vt") == ""
    assert "did you mean 'niah_multikey_1'" in task_problem("niah_multikey1")
    assert "the suite has" in task_problem("qa_1")


@pytest.mark.parametrize("settings, key", [({"tasks": ["vt", "cwe", "vt"]}, ("tasks", 2)),
                                           ({"tasks": ["vt", "needle"]}, ("tasks", 1)),
                                           ({"lengths": [1024, 64]}, ("lengths", 1)),
                                           ({"lengths": [2048, 2048]}, ("lengths", 1))])
def test_a_bad_item_is_reported_at_itself(settings, key):
    with pytest.raises(ValidationError) as info:
        TaskSuite(**settings)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ValueAt) and cause.key == key


@pytest.mark.parametrize("settings", [{"max_drop": -0.5}, {"max_drop": 101}, {"samples": 0}, {"seed": -1},
                                      {"tasks": []}, {"per_task": "sometimes"}])
def test_gate_settings_out_of_bounds_are_refused(settings):
    with pytest.raises(ValidationError):
        TaskGates(**settings)


def test_defaults_are_a_small_informative_suite():
    gates = TaskGates()
    assert gates.lengths == [1024] and gates.samples == 5 and gates.max_drop == 2.0 and not gates.per_task
    assert set(gates.tasks) <= set(TASK_NAMES)
