"""Prefill-time eviction on the compiled engine (float and block kinds): the same kept columns as the eager engine's
EvictingMixin, moved to the static cache's first columns in place, positions from the real tokens, and the eager
engine's greedy tokens (float32 model), at batch 1 and in a left-padded batch. Most tests run the static path
uncompiled (as test_engine.py's); one compiles and checks that eviction never recompiles the step."""

import pytest
import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import estimate_cache_bytes
from runner.infer.cache.static.plain import StaticQuantLayer
from runner.infer.compiled import engine as compiled
from runner.infer.compiled.engine import CompiledEngine
from runner.infer.compiled.state import StaticDecodeState
from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator

PROMPTS = ["one two three four five six seven eight nine ten eleven twelve", "a b c",
           "The quick brown fox jumps over the lazy dog"]  # batch 3: bucket 4, one dummy row; rows of 3 lengths
CASES = [  # every float and block kind, every method, some options
    "fp32+knorm:0.5", "fp16+streaming:0.5:s2", "bf16+tova:0.4", "q8_0+snapkv:0.5:w8", "q4_0+h2o:0.5",
    "q4_1+expected:0.5", "nf4+knorm:0.7", "q8_0+expected:0.3:s4:w4", "q8_0+h2o:0.6:s2", "q8_0+tova:0.5",
    "q8_0+streaming:0.75", "q4_0+knorm:0.5:w8", "fp32+snapkv:0.5",
]


@pytest.fixture
def static_lm(tiny_lm, monkeypatch):
    """tiny_lm whose compiled engine runs its static step uncompiled (as test_engine.py's)."""
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, CompiledEngine(tiny_lm.model, compile=False))
    return tiny_lm


def _generate(lm, prompts, engine, **settings):
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    gen = Generator(lm.model, GenerateConfig(engine=engine, **settings), tokenizer=lm.tokenizer)
    return gen.generate(enc.input_ids, enc.attention_mask), gen


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "padded"])
def test_evicting_kinds_give_the_eager_greedy_tokens(static_lm, kind, prompts):
    eager, eager_gen = _generate(static_lm, prompts, "eager", cache_kind=kind, max_new_tokens=16, temperature=0)
    ours, gen = _generate(static_lm, prompts, "compiled", cache_kind=kind, max_new_tokens=16, temperature=0)
    assert torch.equal(ours, eager)
    state = gen.state
    assert isinstance(state, StaticDecodeState) and state.cache.eviction is not None
    held = eager_gen.state.cache.get_seq_length()
    assert state.column == held < state.length == eager_gen.state.length  # fewer columns than tokens fed
    assert torch.equal(state.mask, eager_gen.state.mask) and torch.equal(state.seen, eager_gen.state.seen)
    assert state.held_bytes() == cache_bytes(eager_gen.state.cache)  # the held tokens' bytes, as eager measures


@pytest.mark.parametrize("kind", ["q8_0+snapkv:0.5:w4", "nf4+h2o:0.5", "fp16+knorm:0.5", "q4_1+expected:0.5"])
def test_the_static_cache_holds_the_eager_layers_kept_tokens_in_its_first_columns(static_lm, kind):
    """The compaction: per (row, KV head), the kept columns in order at 0..k−1, each stored as the eager evicting
    layer stores it (codes and scales of the block kinds moved as they are); a row's pads first, masked."""
    prompts = PROMPTS
    enc = static_lm.tokenizer(prompts, return_tensors="pt", padding=True)
    _, eager_gen = _generate(static_lm, prompts, "eager", cache_kind=kind, max_new_tokens=1, temperature=0)
    _, gen = _generate(static_lm, prompts, "compiled", cache_kind=kind, max_new_tokens=1, temperature=0)
    k = gen.state.column
    assert k == eager_gen.state.cache.get_seq_length() == -(-enc.input_ids.shape[1] // 2)  # ceil(T · 0.5)
    assert gen.state.columns[:, k:].sum() == 0  # the evicted columns masked (the next write goes to column k)
    for ours, theirs in zip(gen.state.cache.static_layers, eager_gen.state.cache.layers):
        if isinstance(ours, StaticQuantLayer):
            for name in ours.TENSORS:
                stored, expected = getattr(ours, name)[:3, :, :k], getattr(theirs, name)
                assert torch.equal(stored, expected), name
        else:  # within one step of the storage dtype: the two paths' float32 projections (GEMMs of other shapes)
            for name in ("keys", "values"):  # round apart in the last bit on some CPUs (AVX-512); a wrong token is far
                stored, expected = getattr(ours, name)[:3, :, :k], getattr(theirs, name).to(ours.storage)
                step = torch.finfo(ours.storage).eps
                torch.testing.assert_close(stored, expected, rtol=step, atol=step * torch.finfo(ours.storage).tiny,
                                           msg=name)
    rows = enc.attention_mask.sum(-1)
    assert torch.equal(gen.state.mask.sum(-1), torch.minimum(rows, torch.tensor(k)))  # each row's real tokens


def test_bytes_are_the_held_tokens_as_estimated_and_the_buffer_stays(static_lm):
    kind, prompts = "q4_0+snapkv:0.5", PROMPTS[:1]
    _, gen = _generate(static_lm, prompts, "compiled", cache_kind=kind, max_new_tokens=6, temperature=0)
    prompt = static_lm.tokenizer(prompts, return_tensors="pt").input_ids.shape[1]
    config, dtype = static_lm.model.config, static_lm.model.dtype
    assert gen.state.held_bytes() == estimate_cache_bytes(config, kind, 1, prompt + 5, dtype, prompt_len=prompt)
    assert cache_bytes(gen.state.cache) == estimate_cache_bytes(config, "q4_0", 1, gen.state.cache.length, dtype)


@pytest.mark.parametrize("kind", ["q8_0+knorm:0.5", "fp32"])
def test_the_bench_reports_the_held_tokens_bytes_on_both_engines_and_the_buffer_apart(static_lm, kind):
    from runner.infer.bench.cells import Cell, measure_ours

    ids = torch.randint(5, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = measure_ours(static_lm.model, ids, Cell(6, kind, repeats=1, warmup=0))
    ours = measure_ours(static_lm.model, ids, Cell(6, kind, repeats=1, warmup=0, engine="compiled"))
    assert ours["kv_mib"] == eager["kv_mib"] and "kv_buffer_mib" not in eager
    held = 12 + 5 if "+" in kind else 24 + 5  # the kept prompt and 5 tokens fed; the 6th is never fed
    per_token = estimate_cache_bytes(static_lm.model.config, kind.split("+")[0], 2, 1, static_lm.model.dtype)
    assert ours["kv_mib"] * 2**20 == held * per_token and ours["kv_buffer_mib"] * 2**20 == 30 * per_token


def test_a_continued_conversation_evicts_each_prompt_forward_as_eager(static_lm):
    """A second turn's prompt forward evicts its own columns, written after the first turn's held ones."""
    enc = static_lm.tokenizer(PROMPTS[:1], return_tensors="pt")
    outs = []
    for engine in ("eager", "compiled"):
        gen = Generator(static_lm.model, GenerateConfig(engine=engine, max_new_tokens=5, temperature=0,
                                                        cache_kind="q8_0+snapkv:0.5:w4"))
        outs.append(torch.cat([gen.generate(enc.input_ids), gen.generate(enc.input_ids[:, :9])], dim=1))
    assert torch.equal(*outs)


def test_a_chunked_prefill_evicts_per_chunk_as_eager(static_lm):
    from runner.infer.cache.registry import make_cache
    from runner.infer.decode.forward import DecodeState

    model, kind = static_lm.model, "q4_0+snapkv:0.5:w4"
    enc = static_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    tokens = []
    with torch.inference_mode():
        for state in (DecodeState(make_cache(kind, model)), compiled.engine_for(model).state(kind, 3, 64, 64)):
            logits, _ = state.prefill(model, enc.input_ids, enc.attention_mask, q_chunk=8)
            chosen = [logits.argmax(-1)]
            for _ in range(6):
                chosen.append(state.feed(model, chosen[-1], torch.ones_like(chosen[-1])).argmax(-1))
            tokens.append((torch.stack(chosen, 1), state.mask.clone()))
    assert torch.equal(tokens[0][0], tokens[1][0]) and torch.equal(tokens[0][1], tokens[1][1])
    width = enc.input_ids.shape[1]
    chunks = [min(8, width - start) for start in range(0, width, 8)]
    assert tokens[1][1].shape[1] == sum(-(-c // 2) if c > 1 else 1 for c in chunks) + 6


def test_beam_search_over_an_evicted_cache_gives_the_eager_beams(static_lm):
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=12, temperature=0, cache_kind="nf4+tova:0.5")
    eager, _ = _generate(static_lm, PROMPTS[:2], "eager", **settings)
    ours, _ = _generate(static_lm, PROMPTS[:2], "compiled", **settings)
    assert torch.equal(ours, eager)


def test_speculative_rounds_on_an_evicting_state_are_refused(static_lm):
    from runner.errors import InferenceError

    state = compiled.engine_for(static_lm.model).state("q8_0+knorm:0.5", 1, 64, 64)
    with pytest.raises(InferenceError, match="speculative decoding verifies chunks of draft tokens"):
        state.feed_row(static_lm.model, torch.tensor([5, 6, 7]))


@pytest.mark.compile
def test_a_compiled_step_decodes_an_evicted_cache_without_recompiling():
    """One shape compiled (about a minute on two loaded cores): a plain q8_0 cache and an evicting one of the same
    shape share the step (eviction changes columns, never shapes), give the eager engine's tokens, and nothing
    recompiles."""
    from runner.infer.loading.models import load_model
    from tests.conftest import TINY_LLAMA

    lm = load_model(config=TINY_LLAMA, device="cpu", seed=3)  # its own model object: its own compiled engine
    plain_eager, _ = _generate(lm, PROMPTS, "eager", cache_kind="q8_0", max_new_tokens=16, temperature=0)
    plain, _ = _generate(lm, PROMPTS, "compiled", cache_kind="q8_0", max_new_tokens=16, temperature=0)
    assert torch.equal(plain, plain_eager)
    stats = compiled.engine_for(lm.model).stats
    compiles = stats.compiles
    for kind in ("q8_0+snapkv:0.5:w4", "q8_0+knorm:0.6"):
        eager, _ = _generate(lm, PROMPTS, "eager", cache_kind=kind, max_new_tokens=16, temperature=0)
        ours, gen = _generate(lm, PROMPTS, "compiled", cache_kind=kind, max_new_tokens=16, temperature=0)
        assert torch.equal(ours, eager) and gen.state.column < gen.state.length
    assert stats.recompiles == 0 and stats.compiles == compiles  # the plain kind's step, reused
    assert len(compiled.engine_for(lm.model).steps) == 1
