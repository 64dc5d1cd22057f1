"""Draft-model speculation under continuous batching (serve/drafting.py): every greedy output equals its solo greedy
decode whatever the draft proposes, the draft caches hold their row's sequence and at most spec_k − 1 guesses,
rejected guesses are cropped, and a preempted or finished request's draft cache goes with it."""

import copy

import pytest
import torch

from runner.infer.serve.blocks import block_spec
from runner.infer.serve.driver import drive
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.requests import Request
from runner.infer.serve.scheduler import Scheduler
from tests.infer.serve.clocks import FakeClock
from tests.infer.serve.test_scheduler import _load, _solo

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def near_draft(tiny_lm):
    """The target with noise on its output head: it agrees with the target on most tokens, not all."""
    draft = copy.deepcopy(tiny_lm.model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = draft.get_output_embeddings().weight
        head += 0.5 * head.std() * torch.randn(head.shape, generator=g)
    return draft


def _requests() -> list[Request]:
    return [Request(r.id, r.arrival_s, r.prompt_ids, r.max_new_tokens + 8) for r in _load()]


def _serve(model, draft, requests, **config) -> tuple[Scheduler, list]:
    """Drive the load, checking after each step what every draft cache holds."""
    clock = FakeClock()
    scheduler = Scheduler(model, SchedulerConfig(spec_k=4, block_size=4, max_tokens_per_step=16, **config),
                          clock=clock, draft=draft)
    inner = scheduler.step

    def step() -> None:
        inner()
        drafter = scheduler.drafter
        running = {live.request.id: live for live in scheduler.running}
        assert set(drafter.caches) <= set(running)  # who left took its draft cache along
        for rid, fed in drafter.fed.items():  # the row's sequence, then at most spec_k − 1 unverified guesses
            checked = drafter.checked[rid]
            assert fed[:checked] == running[rid].sequence[:checked] and len(fed) - checked < 4
            assert drafter.caches[rid].get_seq_length() == len(fed)
    scheduler.step = step
    return scheduler, drive(scheduler, requests, clock, clock.sleep)


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_draft_model_speculation_keeps_every_greedy_output(tiny_lm, near_draft, kind):
    model, requests = tiny_lm.model, _requests()
    solo = [_solo(model, r, kind, temperature=0) for r in requests]
    scheduler, records = _serve(model, near_draft, requests, cache_kind=kind)
    assert [r.output_ids for r in records] == solo
    assert 0 < scheduler.accepted < scheduler.drafted  # the near draft is right often, not always
    assert scheduler.drafter.forwards > 0 and not scheduler.drafter.caches  # all finished: no draft cache left


def test_the_target_as_its_own_draft_is_always_accepted_and_fewer_steps(tiny_lm):
    model, requests = tiny_lm.model, _requests()
    plain_clock = FakeClock()
    plain = Scheduler(model, SchedulerConfig(block_size=4, max_tokens_per_step=16), clock=plain_clock)
    expected = drive(plain, requests, plain_clock, plain_clock.sleep)
    scheduler, records = _serve(model, model, requests)
    assert [r.output_ids for r in records] == [r.output_ids for r in expected]
    assert scheduler.accepted == scheduler.drafted > 0
    assert len(scheduler.timeline) < len(plain.timeline)  # up to spec_k + 1 tokens a step


def test_preempted_requests_recompute_their_draft_cache(tiny_lm, near_draft):
    model, requests = tiny_lm.model, _requests()
    solo = [_solo(model, r, None, temperature=0) for r in requests]
    spec = block_spec(model.config, None, 4, model.dtype)
    tight = max(spec.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests) + 3
    scheduler, records = _serve(model, near_draft, requests, num_blocks=tight)
    assert [r.output_ids for r in records] == solo
    assert sum(r.preemptions for r in records) > 0 and scheduler.accepted > 0


def test_a_draft_model_needs_spec_k(tiny_lm, near_draft):
    with pytest.raises(ValueError, match="set spec_k"):
        Scheduler(tiny_lm.model, SchedulerConfig(), draft=near_draft)
