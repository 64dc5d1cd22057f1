"""The continuous-batching scheduler on the eager engine: each request's greedy output equals its solo greedy
decode for every kind family (arrivals interleaved, chunked prefill, preemption), seeded sampling independent of
the batch, blocks never over budget and bounding the bytes really held, overload refused without a hang, the
static-batching baseline. Fake clocks: nothing sleeps."""

import pytest
import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator
from runner.infer.serve.blocks import BlockPool, block_spec, blocks_in
from runner.infer.serve.driver import drive
from runner.infer.serve.live import SchedulerConfig, request_seed
from runner.infer.serve.requests import Request
from runner.infer.serve.rows import Flushes, chunk_end
from runner.infer.serve.scheduler import Scheduler
from runner.infer.serve.static import StaticBatcher
from tests.infer.serve.clocks import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny batch-1 forwards: extra threads only contend

KINDS = ["fp32", "fp16", "q8_0", "q4_0", "kivi4:g8:r16", "kivi2:g8:r8:s3"]


def _load(n: int = 7, gap_s: float = 0.06, seed: int = 0, **fields) -> list[Request]:
    """n requests of different prompt (3..40) and output (4..24) lengths, arriving every gap_s (tiny vocab: 258)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(3, 41, (1,), generator=g))
        ids = tuple(torch.randint(3, 250, (prompt,), generator=g).tolist())
        out.append(Request(i, arrival_s=i * gap_s, prompt_ids=ids,
                           max_new_tokens=int(torch.randint(4, 25, (1,), generator=g)), **fields))
    return out


def _solo(model, request: Request, kind: str | None, **settings) -> list[int]:
    """The request decoded alone by our Generator: its new tokens up to its stop."""
    rng = settings.pop("rng", None)
    gen = Generator(model, GenerateConfig(max_new_tokens=request.max_new_tokens, cache_kind=kind, **settings),
                    generator=rng)
    out = gen.generate(torch.tensor([request.prompt_ids]))
    return out[0, len(request.prompt_ids):][:gen.stats.new_tokens[0]].tolist()


def _run(model, requests, tokenizer=None, **config) -> tuple[Scheduler, list]:
    clock = FakeClock()
    scheduler = Scheduler(model, SchedulerConfig(**config), clock=clock, tokenizer=tokenizer)
    return scheduler, drive(scheduler, requests, clock, clock.sleep)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_solo_decode_with_interleaved_arrivals_and_preemption(tiny_lm, kind):
    model, requests = tiny_lm.model, _load()
    solo = [_solo(model, r, kind, temperature=0) for r in requests]
    assert len({len(s) for s in solo}) > 2  # rows leave at different times (EOS and lengths)
    roomy, records = _run(model, requests, cache_kind=kind, block_size=4, max_tokens_per_step=16)
    assert [r.output_ids for r in records] == solo
    assert max(t[1] for t in roomy.timeline) >= 3  # several requests really ran together
    spec = block_spec(model.config, kind, 4, model.dtype)
    tight = max(spec.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests) + spec.reserve + 3
    scheduler, records = _run(model, requests, cache_kind=kind, block_size=4, num_blocks=tight,
                              max_tokens_per_step=16)
    assert [r.output_ids for r in records] == solo
    assert sum(r.preemptions for r in records) > 0
    assert max(t[2] for t in scheduler.timeline) <= tight
    assert all(r.finish in ("eos", "length") and r.scheduled_s is not None for r in records)


@pytest.mark.parametrize("kind", ["fp16", "q4_1", "kivi4:g8:r16", "kivi3:k4v2:g8:r16:s5:o1"])
def test_blocks_bound_the_bytes_really_held_and_never_exceed_the_budget(tiny_lm, kind):
    model = tiny_lm.model
    spec = block_spec(model.config, kind, 8, model.dtype)
    budget = blocks_in(60 * spec.block_bytes, spec)
    assert budget == 60
    scheduler = Scheduler(model, SchedulerConfig(cache_kind=kind, block_size=8, kv_budget_bytes=60 * spec.block_bytes,
                                                 max_tokens_per_step=24))
    for request in _load(n=6, min_new_tokens=24):
        scheduler.submit(request)
    while scheduler.busy:
        scheduler.step()
        held = sum(cache_bytes(live.cache) for live in scheduler.running)
        assert held <= scheduler.pool.used * spec.block_bytes <= budget * spec.block_bytes
    assert all(r.finish == "length" for r in scheduler.records.values())


def test_sampling_draws_do_not_depend_on_the_batch(tiny_lm):
    model, requests = tiny_lm.model, _load(n=5)
    sampling = GenerateConfig(temperature=1.0, top_k=50, seed=7)
    _, together = _run(model, requests, sampling=sampling, max_tokens_per_step=12)
    target = requests[2]
    _, alone = _run(model, [target], sampling=sampling)
    assert together[2].output_ids == alone[0].output_ids
    rng = torch.Generator().manual_seed(request_seed(7, target.id))
    assert alone[0].output_ids == _solo(model, target, None, temperature=1.0, top_k=50, rng=rng)
    assert together[0].output_ids != together[1].output_ids  # each request has its own generator


def test_a_full_queue_refuses_and_every_request_is_accounted_for(tiny_lm):
    requests = _load(n=12, gap_s=0.0)  # all at once
    too_long = Request(99, 0.0, tuple(range(3, 43)), max_new_tokens=100)  # 35 blocks > 30
    scheduler, records = _run(tiny_lm.model, [*requests, too_long], max_queue=3, max_running=2, block_size=4,
                              num_blocks=30)
    finishes = [r.finish for r in records]
    assert len(records) == 13 and all(finishes)
    assert finishes.count("refused") == 12 - 3  # all arrive before the first step: 3 wait, the rest are refused
    assert records[-1].finish == "error" and "budget" in records[-1].error
    assert all(r.ok for r in records if r.finish not in ("refused", "error"))
    assert not scheduler.busy


def test_min_new_tokens_ignores_eos_until_reached(tiny_lm):
    requests = [Request(i, 0.0, r.prompt_ids, max_new_tokens=20, min_new_tokens=20) for i, r in enumerate(_load(4))]
    _, records = _run(tiny_lm.model, requests)
    assert [len(r.output_ids) for r in records] == [20] * 4 and {r.finish for r in records} == {"length"}
    assert [r.output_ids for r in records] == [_solo(tiny_lm.model, r, None, temperature=0, eos_token_id=[])
                                               for r in requests]


@pytest.mark.parametrize("kind", ["fp16", "q8_0", "kivi4:g8:r16"])
def test_prefix_caching_copies_shared_prompt_blocks_exactly(tiny_lm, kind):
    model, g = tiny_lm.model, torch.Generator().manual_seed(3)
    shared = tuple(torch.randint(3, 250, (21,), generator=g).tolist())  # 2 full blocks of 8, then 5 tokens
    requests = [Request(i, i * 0.05, shared + tuple(torch.randint(3, 250, (3 + i,), generator=g).tolist()),
                        max_new_tokens=12) for i in range(4)]
    requests.append(Request(4, 0.2, shared[:16], max_new_tokens=6))  # all blocks shared: one token still prefilled
    _, records = _run(model, requests, cache_kind=kind, block_size=8, prefix_caching=True)
    assert [r.output_ids for r in records] == [_solo(model, r, kind, temperature=0) for r in requests]
    hits = [r.cached_prompt_tokens for r in records]
    assert hits == ([0, 16, 16, 16, 8] if kind != "kivi4:g8:r16" else [0] * 5)  # KIVI: off (how it was fed counts)


@pytest.mark.parametrize("kind", ["fp32", "q4_0"])
def test_a_finished_requests_prompt_blocks_serve_a_later_request_exactly(tiny_lm, kind):
    """A conversation's next turn arrives after the last one left: its prompt blocks are still offered (retained),
    and the later request's tokens are still its solo decode's. prefix_cache_blocks 0 keeps none."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(5)
    first = tuple(torch.randint(3, 250, (27,), generator=g).tolist())  # 3 full blocks of 8, then 3 tokens
    requests = [Request(0, 0.0, first, max_new_tokens=5),
                Request(1, 100.0, first + tuple(torch.randint(3, 250, (6,), generator=g).tolist()), max_new_tokens=7),
                Request(2, 200.0, first[:20], max_new_tokens=4)]
    scheduler, records = _run(model, requests, cache_kind=kind, block_size=8, prefix_caching=True)
    assert [r.cached_prompt_tokens for r in records] == [0, 24, 16]  # request 1's own 4 blocks are kept too
    assert [r.output_ids for r in records] == [_solo(model, r, kind, temperature=0) for r in requests]
    assert [scheduler.pool.held[k] for k in scheduler.prefixes.retained] == [4, 3]  # request 0's, used last, last
    _, records = _run(model, requests, cache_kind=kind, block_size=8, prefix_caching=True, prefix_cache_blocks=0)
    assert [r.cached_prompt_tokens for r in records] == [0, 0, 0]


def test_retained_prefixes_stay_within_their_cap_and_give_way_to_requests(tiny_lm):
    """Retained blocks count against the budget, but a request needing them gets them: the least recently used
    prefixes go first, nobody is preempted or kept waiting for them; and there are never more than the cap."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(6)
    prompts = [tuple(torch.randint(3, 250, (16,), generator=g).tolist()) for _ in range(4)]  # 2 blocks each
    requests = [Request(i, 100.0 * i, p, max_new_tokens=4) for i, p in enumerate(prompts)]
    scheduler, records = _run(model, requests, block_size=8, prefix_caching=True, prefix_cache_blocks=5)
    assert [scheduler.pool.held[k] for k in scheduler.prefixes.retained] == [2, 2]  # 3 × 2 blocks > 5: one went
    assert [r.output_ids for r in records] == [_solo(model, r, None, temperature=0) for r in requests]
    big = Request(9, 1000.0, tuple(torch.randint(3, 250, (40,), generator=g).tolist()), max_new_tokens=8)
    scheduler, records = _run(model, [*requests, big], block_size=8, num_blocks=7, prefix_caching=True)
    assert records[-1].finish == "length" and records[-1].preemptions == 0  # 6 blocks: retained ones made room
    assert max(used for _, _, used, _ in scheduler.timeline) <= 7
    assert [k.held for k in scheduler.prefixes.retained.values()] == [40]  # only its own 5 blocks are left
    assert records[-1].output_ids == _solo(model, big, None, temperature=0)


def test_a_stop_string_ends_a_request_as_the_generator_does(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    requests = _load(3)
    free = _solo(model, requests[0], None, temperature=0, eos_token_id=[])
    stop = tok.decode(free[5:7]).strip()[-2:]
    assert stop
    sampling = GenerateConfig(temperature=0, eos_token_id=[], stop_strings=[stop])
    _, records = _run(model, requests, tokenizer=tok, sampling=sampling)
    for request, record in zip(requests, records):
        gen = Generator(model, sampling.model_copy(update={"max_new_tokens": request.max_new_tokens}), tokenizer=tok)
        out = gen.generate(torch.tensor([request.prompt_ids]))[0, len(request.prompt_ids):]
        assert record.output_ids == out[:gen.stats.new_tokens[0]].tolist()
        assert (record.finish == "stop") == (gen.stats.stop_reasons[0] == "stop_string")
    assert records[0].finish == "stop" and len(records[0].output_ids) <= 7


def test_token_times_and_timeline_come_from_the_clock(tiny_lm):
    _, records = _run(tiny_lm.model, _load(n=3, gap_s=5.0))
    for r in records:
        assert r.arrival_s <= r.scheduled_s <= r.token_s[0]
        assert r.token_s == sorted(r.token_s) and len(r.token_s) == len(r.output_ids)
    assert records[1].scheduled_s >= 5.0  # idle until the next arrival: the driver slept


def test_kivi_chunks_end_where_a_solo_decode_would_flush():
    f = Flushes(sinks=2, every=8)  # prompt of 20: exact ends in it 1, 2, 10, 18, 20
    assert [e for e in range(1, 21) if f.exact(0, e, 20)] == [1, 2, 10, 18, 20]
    assert chunk_end(0, 16, 20, 20, f) == (10, True)
    assert chunk_end(10, 13, 20, 20, f) == (18, False)  # over the budget: the nearest exact end
    assert not f.exact(18, 22, 20)  # across the prompt's end
    assert f.exact(25, 26, 40) and f.exact(25, 34, 40) and not f.exact(24, 27, 40)  # 26 completes a flush
    assert chunk_end(3, 7, 5, 5, Flushes()) == (5, True)


def test_the_pool_holds_and_releases_blocks():
    pool = BlockPool(block_spec_for_test(), total=5)
    assert pool.hold(1, 8) and pool.used == 2
    assert not pool.hold(2, 16) and pool.used == 2 and 2 not in pool.tables  # 4 blocks, 3 free: nothing held
    pool.release(1)
    assert pool.free == 5


def block_spec_for_test():
    from runner.infer.serve.blocks import BlockSpec

    return BlockSpec(block_size=4, block_bytes=100, reserve=0)


def test_static_baseline_decodes_fixed_batches(tiny_lm):
    model, requests = tiny_lm.model, _load(n=5, gap_s=0.02)
    clock = FakeClock()
    records = drive(StaticBatcher(model, max_batch_size=2, max_wait_ms=30), requests, clock, clock.sleep)
    assert [r.id for r in records] == [r.id for r in requests]
    assert [r.output_ids for r in records] == [_solo(model, r, None, temperature=0) for r in requests]
    starts = sorted({r.scheduled_s for r in records})
    assert len(starts) == 3  # batches of 2, 2, 1
    assert all(r.token_s[0] >= r.scheduled_s >= r.arrival_s for r in records)


def test_cancel_frees_a_running_and_a_waiting_request_at_once(tiny_lm):
    """A client that goes away (the HTTP server): its blocks and cache go now, and it finishes "cancelled"."""
    first, second = (Request(i, 0.0, tuple(range(3, 30)), 50) for i in range(2))
    scheduler = Scheduler(tiny_lm.model, SchedulerConfig(block_size=4, max_running=1), clock=FakeClock())
    scheduler.submit(first)
    scheduler.submit(second)
    scheduler.step()
    assert [x.request.id for x in scheduler.running] == [0] and len(scheduler.waiting) == 1
    assert scheduler.pool.used > 0
    assert scheduler.cancel(1) and scheduler.cancel(0)
    assert not scheduler.busy and scheduler.pool.used == 0 and scheduler.pool.held == {}
    assert [scheduler.records[i].finish for i in (0, 1)] == ["cancelled", "cancelled"]
    assert not scheduler.cancel(0) and not scheduler.cancel(99)


def test_a_request_samples_by_its_own_settings(tiny_lm):
    """Request.sampling (an HTTP request's temperature and seed) overrides the scheduler's, row by row: two requests
    with the same seed draw the same tokens whatever their ids; a greedy one beside them is its solo greedy decode."""
    prompt = tuple(range(3, 20))
    seeded = GenerateConfig(temperature=1.0, seed=7)
    requests = [Request(0, 0.0, prompt, 12, 12, sampling=seeded), Request(5, 0.0, prompt, 12, 12, sampling=seeded),
                Request(9, 0.0, prompt, 12, sampling=GenerateConfig(temperature=0.0))]
    _, records = _run(tiny_lm.model, requests, sampling=GenerateConfig(temperature=1.0, seed=0))
    assert records[0].output_ids == records[1].output_ids
    assert records[2].output_ids == _solo(tiny_lm.model, requests[2], None, temperature=0)
    assert records[0].output_ids != records[2].output_ids  # sampled at temperature 1 over 258 tokens: not greedy


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "q4_0"])
def test_prompt_lookup_speculation_keeps_every_greedy_output_and_accepts_drafts(tiny_lm, kind):
    """spec_k: each decoding row feeds its last token and ≤ spec_k drafted ones in the step's one forward, keeps
    the target's argmax prefix and crops the rest: the same tokens as a solo greedy decode, roomy or preempted."""
    model = tiny_lm.model
    requests = [Request(r.id, r.arrival_s, r.prompt_ids * 3, r.max_new_tokens + 16) for r in _load()]  # lookups
    solo = [_solo(model, r, kind, temperature=0) for r in requests]
    roomy, records = _run(model, requests, cache_kind=kind, block_size=4, max_tokens_per_step=16, spec_k=4)
    assert [r.output_ids for r in records] == solo
    assert 0 < roomy.accepted < roomy.drafted  # drafts were made, some kept and some cropped
    spec = block_spec(model.config, kind, 4, model.dtype)
    tight = max(spec.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests) + spec.reserve + 3
    scheduler, records = _run(model, requests, cache_kind=kind, block_size=4, num_blocks=tight,
                              max_tokens_per_step=16, spec_k=4)
    assert [r.output_ids for r in records] == solo
    assert sum(r.preemptions for r in records) > 0 and scheduler.accepted > 0
    assert max(t[2] for t in scheduler.timeline) <= tight


def test_speculation_leaves_sampled_requests_alone_and_refuses_grouped_kinds(tiny_lm):
    requests = _load(n=4)
    sampling = GenerateConfig(temperature=1.0, top_k=50, seed=7)
    plain, records = _run(tiny_lm.model, requests, sampling=sampling)
    speculating, same = _run(tiny_lm.model, requests, sampling=sampling, spec_k=4)
    assert [r.output_ids for r in same] == [r.output_ids for r in records] and speculating.drafted == 0
    with pytest.raises(ValueError, match="speculation needs a cache kind that stores each token alone"):
        Scheduler(tiny_lm.model, SchedulerConfig(cache_kind="kivi4:g8:r16", spec_k=4))


def test_a_rejected_draft_gives_its_blocks_back(tiny_lm):
    """After every step a decoding request holds exactly the blocks of the tokens in its cache: the blocks its
    draft took are trimmed back when the verify rejects part of it."""
    scheduler = Scheduler(tiny_lm.model, SchedulerConfig(block_size=2, max_tokens_per_step=64, spec_k=6))
    for r in _load(n=4, gap_s=0.0):
        scheduler.submit(Request(r.id, 0.0, r.prompt_ids * 3, r.max_new_tokens + 16))
    rejected = 0
    while scheduler.busy:
        before = scheduler.drafted - scheduler.accepted
        scheduler.step()
        rejected += scheduler.drafted - scheduler.accepted > before
        for live in (x for x in scheduler.running if x.decoding):
            assert scheduler.pool.held[live.request.id] == scheduler.pool.spec.blocks_for(live.held)
    assert rejected > 0
