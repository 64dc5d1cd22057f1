"""What the steps share: a step's block validated again where it runs fails that step alone, with the reason."""

import pytest

from runner.errors import StepError
from runner.manifest.blocks import GenerateBlock
from runner.manifest.plan import Step
from runner.steps.shared import step_block


def _step(block: dict) -> Step:
    return Step(index=0, target="tiny", run_id="greedy", mode="generate", model={}, block=block, seed=0,
                model_seed=0, hash="0" * 64)


def test_a_block_that_no_longer_validates_is_a_step_error_naming_the_key():
    with pytest.raises(StepError) as caught:
        step_block(GenerateBlock, _step({"max_new_tokens": 0}))
    message = str(caught.value)
    assert message.startswith("step tiny/greedy: its generate settings do not validate: max_new_tokens: ")
    assert "greater than or equal to 1" in message


def test_a_valid_block_comes_back_as_its_model():
    assert step_block(GenerateBlock, _step({"max_new_tokens": 3})).max_new_tokens == 3
