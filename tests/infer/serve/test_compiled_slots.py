"""Continuous batching on the compiled engine (serve/compiled_slots.py): each request's greedy output equals its solo
greedy decode (eager and compiled Generator) with interleaved arrivals, rebases and preemption, KIVI kinds
included (rows aligned to their blocks, a recomputed row's outputs fed again); a load after warm-up never recompiles;
KIVI with sinks is refused with its reason. Most tests run the engine's static step uncompiled
(CompiledEngine(compile=False): the same cache, masks and step function, without inductor); one compiles."""

import pytest
import torch

from runner.infer.compiled import engine as compiled
from runner.infer.compiled.engine import CompiledEngine
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import compiled_serve_reason
from runner.infer.generation.generator import Generator
from runner.infer.serve.blocks import block_spec
from runner.infer.serve.compiled_slots import CompiledSlots
from runner.infer.serve.driver import drive
from runner.infer.serve.requests import Request
from tests.infer.serve.clocks import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["fp32", "fp16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4:g8:r16", "kivi2:g4:r8"]


def _load(n: int = 7, gap_s: float = 0.06, seed: int = 0) -> list[Request]:
    """n requests of prompt 3..40 and output 4..24 tokens, arriving every gap_s (tiny vocab: 258)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(3, 41, (1,), generator=g))
        ids = tuple(torch.randint(3, 250, (prompt,), generator=g).tolist())
        out.append(Request(i, arrival_s=i * gap_s, prompt_ids=ids,
                           max_new_tokens=int(torch.randint(4, 25, (1,), generator=g))))
    return out


def _solo(model, request: Request, kind: str | None, engine: str = "eager") -> list[int]:
    gen = Generator(model, GenerateConfig(max_new_tokens=request.max_new_tokens, cache_kind=kind, temperature=0,
                                          engine=engine))
    out = gen.generate(torch.tensor([request.prompt_ids]))
    return out[0, len(request.prompt_ids):][:gen.stats.new_tokens[0]].tolist()


@pytest.fixture
def static_engine(tiny_lm, monkeypatch):
    """tiny_lm's compiled engine running its static step uncompiled (for the server and the compiled Generator)."""
    engine = CompiledEngine(tiny_lm.model, compile=False)
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, engine)
    return engine


def _run(model, requests, engine, columns=64, **config):
    from runner.infer.serve.live import SchedulerConfig

    clock = FakeClock()
    server = CompiledSlots(model, SchedulerConfig(**config), clock=clock, columns=columns, engine=engine)
    return server, drive(server, requests, clock, clock.sleep)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_solo_decode_with_interleaved_arrivals_rebases_and_preemption(tiny_lm, static_engine, kind):
    model, requests = tiny_lm.model, _load(10, gap_s=0.03, seed=1)
    solo = [_solo(model, r, kind) for r in requests]
    assert len({len(s) for s in solo}) > 2  # rows leave at different times
    server, records = _run(model, requests, static_engine, cache_kind=kind, block_size=4, max_running=4,
                           max_tokens_per_step=48)
    assert [r.output_ids for r in records] == solo
    assert max(t[1] for t in server.timeline) >= 3 and server.rebases > 0  # rows shared steps; c wrapped
    assert (server.stagings > 0) == (server.every > 1)  # KIVI: prefilled requests waited for their block boundary
    spec = block_spec(model.config, kind, 4, model.dtype)
    tight = max(spec.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests) + 3
    server, records = _run(model, requests, static_engine, cache_kind=kind, block_size=4, num_blocks=tight,
                           max_running=4)
    assert [r.output_ids for r in records] == solo
    assert sum(r.preemptions for r in records) > 0 and max(t[2] for t in server.timeline) <= tight
    assert (server.stagings > 0) == (server.every > 1)
    assert all(r.finish in ("eos", "length") for r in records)


@pytest.mark.parametrize("kind", [*KINDS, "kivi3:k4v2:g8:r16:o1"])
def test_greedy_equals_the_compiled_generators_solo_decode_all_at_once(tiny_lm, static_engine, kind):
    requests = [Request(r.id, 0.0, r.prompt_ids, r.max_new_tokens) for r in _load(5, seed=3)]
    solo = [_solo(tiny_lm.model, r, kind, engine="compiled") for r in requests]
    server, records = _run(tiny_lm.model, requests, static_engine, cache_kind=kind, max_running=8)
    assert [r.output_ids for r in records] == solo
    if server.every == 1:  # four left-padded prompts in one forward, then the fifth
        assert sorted(server.prefill_caches) == [1, 4]
    else:  # KIVI: prompts join when their length ≡ the pointer (mod r), so their first tokens start blocks
        assert f":r{server.every}" in kind and server.stagings > 0 and max(t[1] for t in server.timeline) >= 3


@pytest.fixture
def native_engine(tiny_lm, monkeypatch):
    """tiny_lm's compiled engine with its native step, which serves its ≤ 8 float32 rows: nothing is compiled."""
    engine = CompiledEngine(tiny_lm.model)
    if engine.native is None:
        pytest.skip("runner's kernels are not built here (no compiler): no native step, no mixed forwards")
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, engine)
    return engine


@pytest.mark.parametrize("kind", ["fp32", "fp16"])
def test_mixed_forwards_equal_solo_decodes_with_arrivals_rebases_prefix_hits_and_preemption(tiny_lm, native_engine,
                                                                                            kind):
    """On the native step, prompts join in the decode rows' forward (their tokens as extra rows, written into their
    own rows right-aligned to the pointer): outputs are still each request's solo decode, through rebases, prefix
    hits copied from running rows and preemption under a tight budget; nothing is prefilled apart, nothing compiled."""
    model, requests = tiny_lm.model, _load(10, gap_s=0.03, seed=1)
    solo = [_solo(model, r, kind) for r in requests]
    server, records = _run(model, requests, native_engine, cache_kind=kind, block_size=4, max_running=4,
                           max_tokens_per_step=48)
    assert server.mixing and server.shared_forwards > 0 and not server.prefill_caches
    assert [r.output_ids for r in records] == solo
    assert max(t[1] for t in server.timeline) >= 3 and server.rebases > 0
    spec = block_spec(model.config, kind, 4, model.dtype)
    tight = max(spec.blocks_for(len(r.prompt_ids) + r.max_new_tokens) for r in requests) + 3
    server, records = _run(model, requests, native_engine, cache_kind=kind, block_size=4, num_blocks=tight,
                           max_running=4)
    assert [r.output_ids for r in records] == solo and sum(r.preemptions for r in records) > 0
    g = torch.Generator().manual_seed(3)
    shared = tuple(torch.randint(3, 250, (21,), generator=g).tolist())
    requests = [Request(i, i * 0.05, shared + tuple(torch.randint(3, 250, (3 + i,), generator=g).tolist()),
                        max_new_tokens=12) for i in range(4)]
    server, records = _run(model, requests, native_engine, cache_kind=kind, block_size=8, prefix_caching=True,
                           max_running=8)
    assert [r.output_ids for r in records] == [_solo(model, r, kind) for r in requests]
    assert [r.cached_prompt_tokens for r in records] == [0, 16, 16, 16]
    assert native_engine.stats.compiles == 0 and not native_engine.steps


def test_a_request_longer_than_a_row_is_an_error_and_kivi_with_sinks_is_refused_with_its_reason(tiny_lm,
                                                                                                 static_engine):
    _, records = _run(tiny_lm.model, [Request(0, 0.0, tuple(range(3, 60)), 10)], static_engine, columns=64)
    assert records[0].finish == "error" and "hold 64" in records[0].error
    assert compiled_serve_reason("q4_0") == compiled_serve_reason("kivi4:g8:r16") == ""
    assert "first columns" in compiled_serve_reason("kivi2:g8:r8:s3")
    with pytest.raises(ValueError, match=r"cannot be served on the compiled engine: KIVI with sinks \(s4\)"):
        CompiledSlots(tiny_lm.model, _config(cache_kind="kivi4:s4"), engine=static_engine)


def _config(**fields):
    from runner.infer.serve.live import SchedulerConfig

    return SchedulerConfig(**fields)


@pytest.mark.compile
def test_a_compiled_load_equals_solo_decodes_and_never_recompiles(tiny_lm, monkeypatch, tmp_path):
    """Really compiled: one graph made in warm-up, none while the load runs (joins, leaves, rebases)."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    engine = CompiledEngine(tiny_lm.model)
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, engine)
    requests = _load(6, seed=1)
    solo = [_solo(tiny_lm.model, r, "q8_0") for r in requests]
    server, records = _run(tiny_lm.model, requests, engine, cache_kind="q8_0", max_running=4)
    assert [r.output_ids for r in records] == solo
    assert server.compiles >= 1 and server.compile_s > 0 and server.recompiles == 0 and server.rebases > 0


def test_a_roomy_cache_rebases_before_it_is_full_and_still_equals_solo_decodes(tiny_lm, static_engine):
    """S = 512 and rows of at most 64 tokens: the pointer moves back whenever it passes 2·W + SLACK, so attention
    never reads mostly holes."""
    requests = _load(6, seed=2)
    solo = [_solo(tiny_lm.model, r, "fp32") for r in requests]
    server, records = _run(tiny_lm.model, requests, static_engine, columns=512, cache_kind="fp32", max_running=4)
    assert [r.output_ids for r in records] == solo
    assert server.rebases > 0 and server.pointer < 2 * 64 + 64


def test_cancel_frees_a_row_and_its_blocks(tiny_lm, static_engine):
    """Scheduler.cancel on the compiled slots: the row is free for the next request, whose output is unchanged."""
    slots = CompiledSlots(tiny_lm.model, _config(block_size=4, max_running=2), engine=static_engine, columns=64,
                          clock=FakeClock())
    gone, kept = Request(0, 0.0, tuple(range(3, 20)), 30), Request(1, 0.0, tuple(range(5, 25)), 8)
    slots.submit(gone)
    slots.step()
    assert slots.slot_of == {0: 0} and slots.pool.used > 0
    assert slots.cancel(0)
    assert slots.slot_of == {} and slots.pool.used == 0 and int(slots.mask.sum()) == 0
    assert slots.records[0].finish == "cancelled"
    slots.submit(kept)
    while slots.busy:
        slots.step()
    assert slots.records[1].output_ids == _solo(tiny_lm.model, kept, None, engine="compiled")


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "kivi4:g8:r16"])
def test_prefix_caching_copies_a_running_rows_prefix_and_saves_its_prefill(tiny_lm, static_engine, kind):
    """Requests sharing a 21-token prompt start (2 full blocks of 8) arrive while the first runs: their prefills copy
    its 16 columns and feed the rest (equal hits together), and every output is still its solo decode. KIVI: off."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(3)
    shared = tuple(torch.randint(3, 250, (21,), generator=g).tolist())
    requests = [Request(i, i * 0.05, shared + tuple(torch.randint(3, 250, (3 + i,), generator=g).tolist()),
                        max_new_tokens=12) for i in range(4)]
    requests.append(Request(4, 0.2, shared[:16], max_new_tokens=6))  # all blocks cached: one token still fed
    server, records = _run(model, requests, static_engine, cache_kind=kind, block_size=8, prefix_caching=True,
                           max_running=8)
    assert [r.output_ids for r in records] == [_solo(model, r, kind) for r in requests]
    hits = [r.cached_prompt_tokens for r in records]
    assert hits == ([0, 16, 16, 16, 8] if server.every == 1 else [0] * 5)
    assert server.pool.used == sum(server.pool.held[k] for k in server.kept)  # no blocks shared: all given back


def test_a_finished_requests_prompt_is_kept_within_its_cap_and_serves_a_later_one(tiny_lm, static_engine):
    """A request arriving after the last one left finds its prompt blocks in a one-row copy (charged to the
    budget, counted in kv_bytes); the cap drops the least recently used; outputs stay their solo decodes."""
    model, g = tiny_lm.model, torch.Generator().manual_seed(5)
    first = tuple(torch.randint(3, 250, (27,), generator=g).tolist())  # 3 full blocks of 8, then 3 tokens
    other = tuple(torch.randint(3, 250, (17,), generator=g).tolist())  # 2 full blocks
    requests = [Request(0, 0.0, first, max_new_tokens=5),
                Request(1, 100.0, other, max_new_tokens=4),
                Request(2, 200.0, first[:20] + (7, 8), max_new_tokens=6)]
    server, records = _run(model, requests, static_engine, cache_kind="q4_0", block_size=8, prefix_caching=True)
    assert [r.cached_prompt_tokens for r in records] == [0, 0, 16]
    assert [r.output_ids for r in records] == [_solo(model, r, "q4_0") for r in requests]
    assert sorted(server.pool.held[k] for k in server.kept) == [2, 3] == sorted(
        server.pool.held[k] for k in server.prefixes.retained)  # request 2's 2 blocks were request 0's
    static = sum(t.nbytes for layer in server.cache.static_layers for t in layer.tensors())
    assert server.kv_bytes() > static
    server, records = _run(model, requests, static_engine, cache_kind="q4_0", block_size=8, prefix_caching=True,
                           prefix_cache_blocks=4)
    assert [r.cached_prompt_tokens for r in records] == [0, 0, 0]  # request 0's 3 blocks went for request 1's 2
    assert sorted(server.kept) == sorted(server.prefixes.retained)  # requests 1's and 2's, 2 blocks each
    assert [server.pool.held[k] for k in server.kept] == [2, 2]


def test_prefix_caching_under_a_tight_budget_with_preemption_equals_solo_decodes(tiny_lm, static_engine):
    """Prompts that share prefixes of many lengths, arriving in bursts, under 9 blocks of 4 with a retained-prefix
    cap of 8: requests are preempted and recomputed, retained copies evicted, hits taken from rows and copies, and
    every output is still its solo decode."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 250, (24,), generator=g).tolist()
    requests = []
    for i in range(8):
        keep = int(torch.randint(4, 25, (1,), generator=g))
        tail = torch.randint(3, 250, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        requests.append(Request(i, 0.02 * i + (1.0 if i >= 4 else 0.0), tuple(shared[:keep] + tail),
                                max_new_tokens=int(torch.randint(2, 12, (1,), generator=g))))
    server, records = _run(tiny_lm.model, requests, static_engine, cache_kind="fp32", block_size=4, num_blocks=9,
                           max_running=4, prefix_caching=True, prefix_cache_blocks=8)
    assert [r.output_ids for r in records] == [_solo(tiny_lm.model, r, "fp32") for r in requests]
    assert sum(r.cached_prompt_tokens for r in records) > 0 and sum(r.preemptions for r in records) > 0
    assert max(t[2] for t in server.timeline) <= 9
