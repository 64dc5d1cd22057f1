"""The physical KV pool: block ids shared and reused, a request's tokens in its blocks stored and read back exactly
as the kind's own layer stores them, the storage never over the budget, a shared prefix stored once (so a budget
admits more requests that share it)."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from runner.infer.cache.registry import KINDS
from runner.infer.config.kinds import parse_kind
from runner.infer.serve.blocks import BlockPool, BlockSpec
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.paged import PagedStore, pageable
from runner.infer.serve.requests import Request
from runner.infer.serve.scheduler import Scheduler
from tests.infer.serve.test_scheduler import _run, _solo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_blocks_are_shared_by_reference_and_the_lowest_free_id_goes_first():
    pool = BlockPool(BlockSpec(block_size=4, block_bytes=10, reserve=0), total=6)
    assert pool.hold(1, 12) and pool.tables[1] == [0, 1, 2]
    pool.share(2, 1, 2)  # request 2 starts with request 1's first two blocks
    assert pool.hold(2, 12) and pool.tables[2] == [0, 1, 3] and pool.used == 4
    pool.release(1)  # blocks 0 and 1 stay: request 2 holds them
    assert pool.used == 3 and pool.refs == {0: 1, 1: 1, 3: 1}
    assert pool.hold(3, 8) and pool.tables[3] == [2, 4]  # freed 2 before the new 4
    assert not pool.hold(4, 8) and 4 not in pool.tables and pool.used == 5  # 2 blocks, 1 free: none taken
    pool.trim(2, 5)  # 5 tokens need 2 blocks: block 3 goes back, in place
    assert pool.tables[2] == [0, 1] and pool.free == 2


@pytest.mark.parametrize("kind", [None, "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4"])
def test_a_request_reads_back_what_its_kinds_own_layer_would_store(kind):
    """Chunks of a prefill and single decoded tokens, into blocks scattered over the pool: every update returns
    the same K/V, bit for bit, as the kind's eager layer (the model's dtype: transformers' DynamicLayer)."""
    g = torch.Generator().manual_seed(0)
    store = PagedStore(kind, torch.float32, n_layers=1, block_size=4, total_blocks=16)
    table = [9, 2, 14, 0, 5]
    paged = store.cache(table, 0).layers[0]
    own = DynamicLayer() if kind is None else KINDS[parse_kind(kind).name].eager(parse_kind(kind))
    for t in (7, 1, 1, 6, 1):
        key, value = torch.randn(1, 2, t, 64, generator=g), torch.randn(1, 2, t, 64, generator=g)
        got, want = paged.update(key, value), own.update(key, value)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert paged.get_seq_length() == 16 and store.capacity_blocks == 16  # 10, then doubled: capped at the total
    paged.crop(-3)
    key, value = torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    own.crop(-3)
    assert all(torch.equal(a, b) for a, b in zip(paged.update(key, value), own.update(key, value)))


def test_pageable_kinds_are_those_that_store_each_token_alone():
    assert all(pageable(k) for k in (None, "fp32", "bf16", "q8_0", "nf4"))
    assert not any(pageable(k) for k in ("kivi4", "kivi2:g8:r8:s2", "q8_0+snapkv:0.5"))


@pytest.mark.parametrize("kind", ["fp16", "q8_0"])
def test_the_pool_never_holds_more_than_the_budget(tiny_lm, kind):
    """An overloaded budget (preemptions): the storage stays within the budget's bytes, the tokens stay exact."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(1)
    requests = [Request(i, 0.01 * i, tuple(torch.randint(3, 250, (int(torch.randint(5, 30, (1,), generator=g)),),
                                                       generator=g).tolist()), max_new_tokens=16) for i in range(6)]
    budget = 40_000
    scheduler, records = _run(model, requests, cache_kind=kind, block_size=4, kv_budget_bytes=budget)
    assert sum(r.preemptions for r in records) > 0
    assert 0 < scheduler.store.nbytes() <= budget and scheduler.store.capacity_blocks <= scheduler.pool.total
    assert [r.output_ids for r in records] == [_solo(model, r, kind, temperature=0) for r in requests]


def test_a_shared_prefix_is_stored_once_so_the_budget_admits_more(tiny_lm):
    """Four requests share a 56-token prompt prefix (7 blocks of 8) and need 8 blocks each alone. Under 14 blocks
    without prefix caching one runs at a time; with it the prefix is stored once and all four run together."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(2)
    shared = tuple(torch.randint(3, 250, (56,), generator=g).tolist())
    requests = [Request(i, 0.0, shared + tuple(torch.randint(3, 250, (4,), generator=g).tolist()), max_new_tokens=4,
                        min_new_tokens=4) for i in range(4)]
    peaks = {}
    for caching in (False, True):
        scheduler, records = _run(model, requests, block_size=8, num_blocks=14, prefix_caching=caching)
        assert [r.output_ids for r in records] == [_solo(model, r, None, temperature=0, eos_token_id=[])
                                                   for r in requests]
        peaks[caching] = max(running for _, running, _, _ in scheduler.timeline)
        assert max(used for _, _, used, _ in scheduler.timeline) <= 14
    assert peaks == {False: 1, True: 4}  # 7 shared + 4 × 1 own blocks = 11


def test_a_prefix_outlives_its_owner_while_a_sharer_holds_it(tiny_lm):
    """The owner of a shared prefix is cancelled while a request sharing its blocks runs: a later request still finds
    the prefix (offered now by the sharer) and its tokens are still its solo decode's."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(4)
    shared = tuple(torch.randint(3, 250, (16,), generator=g).tolist())  # 2 blocks of 8
    requests = [Request(i, 0.0, shared + tuple(torch.randint(3, 250, (3,), generator=g).tolist()), max_new_tokens=12,
                        min_new_tokens=12) for i in range(3)]
    scheduler = Scheduler(model, SchedulerConfig(block_size=8, prefix_caching=True))
    first = scheduler.submit(requests[0])
    while not first.output_ids:  # its prompt is in: it offers its blocks
        scheduler.step()
    second = scheduler.submit(requests[1])
    while len(second.output_ids) < 2:
        scheduler.step()
    assert second.cached_prompt_tokens == 16 and scheduler.cancel(0)
    third = scheduler.submit(requests[2])
    while scheduler.busy:
        scheduler.step()
    assert first.finish == "cancelled" and third.cached_prompt_tokens == 16
    assert [second.output_ids, third.output_ids] == [_solo(model, r, None, temperature=0, eos_token_id=[])
                                                     for r in requests[1:]]
