"""The compiled engine: static caches of every kind give the eager engine's tokens; the compiled step does too.

Most tests run the engine's static path uncompiled (CompiledEngine(compile=False): the same caches, masks, buckets
and step function, without inductor), so every kind and strategy is checked in seconds. The tests that really
compile are few and marked compile.
"""

import copy
from collections import Counter

import pytest
import torch
from pydantic import ValidationError
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from runner.infer.cache import codebooks
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import bytes_per_token
from runner.infer.cache.static.cache import STATIC_KINDS, static_length
from runner.infer.cache.static.kivi import StaticKiviLayer
from runner.infer.cache.static.plain import StaticQuantLayer
from runner.infer.compiled import engine as compiled
from runner.infer.compiled import state as static_state
from runner.infer.compiled.engine import (
    CompiledEngine,
    batch_bucket,
    compile_options,
    input_major_weights,
    length_bucket,
)
from runner.infer.compiled.state import StaticDecodeState, prefill_pieces
from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig
from runner.infer.config.kinds import parse_kind
from runner.infer.decode.forward import DecodeStateProtocol
from runner.infer.generation.generator import Generator
from runner.infer.kernels import cpu_linear
from runner.infer.speculative.generator import PROMPT_LOOKUP, SpeculativeGenerator

PROMPTS = ["hello world, this is", "a", "The quick brown fox"]  # batch 3: bucket 4, one dummy row
KIVI_FLUSHING = ["kivi4:g8:r16", "kivi2:g4:r8", "kivi3:k4v2:g8:r16", "kivi2:g4:r8:b8", "kivi4:g8:r16:s4",
                 "kivi3:k4v3:g8:r16:s3:b8", "kivi4:g8:r16:o2", "kivi3:g8:r16:rotv:nuq",
                 "kivi2:g4:r8:s4:o2:b8:nuq:rot"]  # blocks complete often within 20 new tokens


@pytest.fixture
def static_lm(tiny_lm, monkeypatch, tmp_path):
    """tiny_lm whose compiled engine runs its static step uncompiled (nuq codes fitted into a fresh directory)."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(codebooks, "_FITTED", {})
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, CompiledEngine(tiny_lm.model, compile=False))
    return tiny_lm


def _graph_breaks() -> Counter:
    """Dynamo's graph breaks so far in this process, by reason: a compiled step must have none (each one a return to
    Python in the middle of a step, and a graph more)."""
    return Counter(torch._dynamo.utils.counters["graph_break"])


def _generate(lm, prompts, engine, **settings):
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    gen = Generator(lm.model, GenerateConfig(engine=engine, **settings), tokenizer=lm.tokenizer)
    return gen.generate(enc.input_ids, enc.attention_mask), gen


def test_buckets_round_up_and_respect_max_seq_len():
    assert [batch_bucket(b) for b in (1, 3, 5, 9, 300)] == [1, 4, 8, 16, 300]
    assert length_bucket(10, 2048) == 256 and length_bucket(300, 2048) == 512
    assert length_bucket(300, 400) == 400 and length_bucket(500, 400) == 500


@pytest.mark.parametrize("kind", [*STATIC_KINDS, *KIVI_FLUSHING])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "padded"])
def test_static_caches_give_the_eager_greedy_tokens(static_lm, kind, prompts):
    eager, eager_gen = _generate(static_lm, prompts, "eager", cache_kind=kind, max_new_tokens=20, temperature=0)
    ours, gen = _generate(static_lm, prompts, "compiled", cache_kind=kind, max_new_tokens=20, temperature=0)
    assert torch.equal(ours, eager)
    assert isinstance(gen.state, StaticDecodeState) and gen.state.cache.batch == batch_bucket(len(prompts))
    assert isinstance(gen.state, DecodeStateProtocol) and isinstance(eager_gen.state, DecodeStateProtocol)


@pytest.mark.parametrize("kind", ["kivi4:g8:r16:s4", "kivi2:g4:r8:s4:o2:b8:nuq:rot"])
def test_a_prompt_shorter_than_the_sinks_gives_the_eager_greedy_tokens(static_lm, kind):
    """A one-token prompt: the first steps write sink columns, which the one-column graph does not keep
    (StaticKVCache.needs_coding), so they run as eager static steps; the tokens are still the eager engine's."""
    eager, _ = _generate(static_lm, PROMPTS[1:2], "eager", cache_kind=kind, max_new_tokens=12, temperature=0)
    ours, gen = _generate(static_lm, PROMPTS[1:2], "compiled", cache_kind=kind, max_new_tokens=12, temperature=0)
    assert torch.equal(ours, eager) and gen.state.cache.layers[0].sinks == 4


def test_prefill_pieces_are_whole_pieces_then_a_power_of_two():
    assert prefill_pieces(5) == [(5, 16)] and prefill_pieces(16) == [(16, 16)] and prefill_pieces(17) == [(17, 32)]
    assert prefill_pieces(1100) == [(512, 512), (512, 512), (76, 128)] and prefill_pieces(1024) == [(512, 512)] * 2


@pytest.fixture
def small_pieces(monkeypatch):
    """Compiled prefill pieces of 4..16 columns: the tiny prompts span several pieces and a padded last one."""
    monkeypatch.setattr(static_state, "PREFILL_MIN", 4)
    monkeypatch.setattr(static_state, "PREFILL_MAX", 16)


LONG_PROMPTS = ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen", "a b",
                "The quick brown fox jumps over the lazy dog and runs far away"]


@pytest.mark.parametrize("kind", [None, "q4_0", "kivi4:g8:r16", "kivi2:g4:r8", "kivi3:g8:r16", "kivi2:g4:r8:s8:b8",
                                  "kivi2:g4:r8:s8:o2:b8:nuq:rot"])
@pytest.mark.parametrize("prompts", [LONG_PROMPTS[:1], LONG_PROMPTS], ids=["batch1", "padded"])
def test_compiled_prefill_in_padded_pieces_gives_the_eager_greedy_tokens(static_lm, small_pieces, kind, prompts):
    """KIVI: every piece ends on a block (s + a multiple of r), so a piece's queries see its columns as the one
    eager forward's do; a piece ending inside a block (e.g. s5 here) shows them its last columns unquantized."""
    eager, _ = _generate(static_lm, prompts, "eager", cache_kind=kind, max_new_tokens=20, temperature=0)
    ours, gen = _generate(static_lm, prompts, "compiled", cache_kind=kind, max_new_tokens=20, temperature=0,
                          prefill="compiled")
    assert torch.equal(ours, eager)
    width = static_lm.tokenizer(prompts, return_tensors="pt", padding=True).input_ids.shape[1]
    assert gen.state.compiled_prefill and {p for _, p in prefill_pieces(width)} <= set(gen.state.step_lengths)


def test_a_compiled_prefill_continues_a_conversation_with_pieces_it_did_not_compile(static_lm, small_pieces):
    enc = static_lm.tokenizer(LONG_PROMPTS[:1], return_tensors="pt")
    outs = []
    for engine, prefill in (("eager", "eager"), ("compiled", "compiled")):
        gen = Generator(static_lm.model, GenerateConfig(engine=engine, prefill=prefill, max_new_tokens=5,
                                                        temperature=0, cache_kind="kivi4:g8:r16"))
        outs.append(torch.cat([gen.generate(enc.input_ids), gen.generate(enc.input_ids[:, :7])], dim=1))
    assert torch.equal(*outs)


@pytest.mark.parametrize("kind", [k for k in STATIC_KINDS if not k.startswith("kivi")])  # KIVI: test_static.py
def test_static_cache_holds_the_estimated_bytes_of_all_its_columns(static_lm, kind):
    _, gen = _generate(static_lm, PROMPTS[:1], "compiled", cache_kind=kind, max_new_tokens=2, temperature=0)
    per_token = bytes_per_token(static_lm.model.config, kind, static_lm.model.dtype)
    assert cache_bytes(gen.cache) == per_token * gen.cache.length  # codes + scales, never the float K/V


def test_an_engine_keeps_its_most_recently_used_caches_and_frees_the_others(tiny_lm):
    import gc
    import weakref

    engine = CompiledEngine(tiny_lm.model, compile=False, max_caches=2)
    first = weakref.ref(engine.state("q8_0", 1, 10, 2048).cache)  # the state is dropped at once
    for kind, batch in (("fp32", 1), ("q8_0", 3), ("fp32", 1), ("kivi4", 2)):
        state = engine.state(kind, batch, 10, 2048)
    gc.collect()
    assert list(engine.caches) == [("fp32", 1, 256, ""), ("kivi4", 2, 256, "")] and state.cache is engine.caches[
        ("kivi4", 2, 256, "")]
    assert first() is None  # its memory went back


def test_seeded_sampling_is_reproducible_and_stop_rules_apply(static_lm):
    settings = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=7)
    first, _ = _generate(static_lm, PROMPTS, "compiled", **settings)
    again, _ = _generate(static_lm, PROMPTS, "compiled", **settings)
    assert torch.equal(first, again)
    eos = int(first[0, -12])  # row 0's first new token, made an EOS: row 0 stops at once, the others go on
    stopped, gen = _generate(static_lm, PROMPTS, "compiled", **settings, eos_token_id=eos)
    assert gen.stats.stop_reasons[0] == "eos" and gen.stats.new_tokens[0] == 1


@pytest.mark.parametrize("kind", [None, "kivi4:g8:r16"])
def test_beam_search_reorders_the_static_cache_like_the_eager_one(static_lm, kind):
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=20, temperature=0, cache_kind=kind)
    eager, _ = _generate(static_lm, PROMPTS[:2], "eager", **settings)
    ours, _ = _generate(static_lm, PROMPTS[:2], "compiled", **settings)
    assert torch.equal(ours, eager)


def test_continuing_a_conversation_writes_after_the_first_turn(static_lm):
    enc = static_lm.tokenizer(PROMPTS[:1], return_tensors="pt")
    outs = []
    for engine in ("eager", "compiled"):
        gen = Generator(static_lm.model, GenerateConfig(engine=engine, max_new_tokens=5, temperature=0))
        outs.append(torch.cat([gen.generate(enc.input_ids), gen.generate(enc.input_ids[:, :2])], dim=1))
    assert torch.equal(*outs)


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "nf4", *KIVI_FLUSHING])
def test_speculative_verification_on_static_states_gives_the_target_greedy_tokens(static_lm, kind):
    enc = static_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    outs = []
    for engine in ("eager", "compiled"):
        config = SpeculativeConfig(spec_k=3, max_new_tokens=16, temperature=0, cache_kind=kind, engine=engine)
        outs.append(SpeculativeGenerator(static_lm.model, "prompt-lookup", config).generate(enc.input_ids,
                                                                                           enc.attention_mask))
    assert torch.equal(*outs)


@pytest.mark.parametrize("kind", ["kivi2:g4:r8", "kivi2:g4:r8:s3", "kivi2:g4:r8:s3:o2:nuq:rot"])
@pytest.mark.parametrize("held, kept", [(21, 13), (21, 17), (30, 9), (30, 2)])
def test_a_static_kivi_state_cropped_across_blocks_gives_the_eager_caches_logits(static_lm, kind, held, kept):
    """A crop into quantized blocks returns their kept columns to full precision dequantized (as the eager
    KiviLayer does); the logits after it then agree to float rounding (without the rollback: 4e-4 to 0.1)."""
    from runner.infer.cache.registry import make_cache
    from runner.infer.speculative.generator import crop_to, feed

    model = static_lm.model
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.inference_mode():
        for cache in (make_cache(kind, model), compiled.engine_for(model).state(kind, 1, 64, 64)):
            feed(model, cache, tokens[:held])
            crop_to(cache, kept)
            logits.append(feed(model, cache, tokens[held:held + 9], keep=9))
    torch.testing.assert_close(*logits, rtol=0, atol=1e-5)


def test_a_model_drafting_for_itself_gets_two_static_caches(static_lm):
    enc = static_lm.tokenizer(PROMPTS[:1], return_tensors="pt")
    config = SpeculativeConfig(spec_k=3, max_new_tokens=12, temperature=0, engine="compiled")
    gen = SpeculativeGenerator(static_lm.model, static_lm.model, config)
    out = gen.generate(enc.input_ids)
    target_only, _ = _generate(static_lm, PROMPTS[:1], "eager", max_new_tokens=12, temperature=0)
    assert torch.equal(out, target_only) and gen.stats.acceptance_rate == 1.0


def test_a_prompt_longer_than_max_seq_len_is_refused_before_anything_compiles(static_lm):
    """Seen: a minute of compiling, then this error; generate mode refused at once."""
    from runner.errors import InferenceError

    enc = static_lm.tokenizer(PROMPTS[:1], return_tensors="pt")
    config = SpeculativeConfig(spec_k=3, max_new_tokens=4, max_seq_len=4, temperature=0, engine="compiled")
    with pytest.raises(InferenceError, match=f"prompt of {enc.input_ids.shape[1]} tokens does not fit max_seq_len=4"):
        SpeculativeGenerator(static_lm.model, PROMPT_LOOKUP, config).generate(enc.input_ids)
    assert compiled.engine_for(static_lm.model).stats.compile_s == {}


@pytest.mark.parametrize("settings, key", [
    ({"penalty_alpha": 0.5, "top_k": 4, "temperature": 0}, "penalty_alpha"),
    ({"decode_plan": "auto"}, "decode_plan"),
    ({"prefill": "compiled"}, "prefill"),
])
def test_what_the_compiled_engine_cannot_serve_is_a_config_error_naming_the_key(settings, key):
    if key == "prefill":  # the other way round: compiled prefill needs the compiled engine
        GenerateConfig(engine="compiled", **settings)
        with pytest.raises(ValidationError, match=key):
            GenerateConfig(engine="eager", **settings)
        return
    GenerateConfig(engine="eager", **settings)  # fine on the eager engine
    with pytest.raises(ValidationError, match=key):
        GenerateConfig(engine="compiled", **settings)


@pytest.mark.compile
def test_compiled_step_gives_the_eager_greedy_tokens_and_never_recompiles(monkeypatch):
    """Compiles five shapes (about a minute each on two loaded cores): fp32 at batch 1, fp32, nf4 and KIVI (blocks
    completed every 16 columns) padded, and the last one's compiled prefill piece (20 prompt columns → 32). nf4
    once recompiled at its first real step (its level table was cached in a dict while tracing). The graph is what
    is tested: the native C++ step, which would take fp32's one-column steps, is off (test_native_step.py)."""
    from runner.infer.loading.models import load_model
    from tests.conftest import TINY_LLAMA

    lm = load_model(config=TINY_LLAMA, device="cpu", seed=1)  # its own model object: its own compiled engine
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, lm.model, CompiledEngine(lm.model, native=False))
    breaks = _graph_breaks()
    for kind, prompts, prefill in (("fp32", PROMPTS[:1], "eager"), ("fp32", PROMPTS, "eager"),
                                   ("nf4", PROMPTS, "eager"), ("kivi4:g8:r16", PROMPTS, "compiled")):
        eager, _ = _generate(lm, prompts, "eager", cache_kind=kind, max_new_tokens=24, temperature=0)
        ours, _ = _generate(lm, prompts, "compiled", cache_kind=kind, max_new_tokens=24, temperature=0,
                            prefill=prefill)
        again, _ = _generate(lm, prompts, "compiled", cache_kind=kind, max_new_tokens=24, temperature=0,
                             prefill=prefill)
        assert torch.equal(ours, eager) and torch.equal(again, eager)
    stats = compiled.engine_for(lm.model).stats
    assert sorted(key[-1] for key in stats.compile_s) == [1, 1, 1, 1, 32] and stats.recompiles == 0  # 17..32 columns
    assert not _graph_breaks() - breaks, list(_graph_breaks() - breaks)  # each step is one whole graph
    # each step function holds one graph (KIVI's one-column step: two functions), so skipping guards after a
    # step's first call never runs a graph made for another shape
    steps = compiled.engine_for(lm.model).steps
    assert sorted(key[3:] for key in steps) == [(1, False)] * 4 + [(1, True), (32, True)]
    for step in steps.values():
        assert len(_debug_get_cache_entry_list(step._torchdynamo_orig_callable.__code__)) == 1
    if cpu_linear.load():  # each compiled step's products ran on runner's kernel: one call per Linear
        with torch.profiler.profile() as profile:
            _generate(lm, PROMPTS[:1], "compiled", cache_kind="fp32", max_new_tokens=4, temperature=0)
        calls = sum(event.count for event in profile.key_averages() if event.key == "runner::linear_rows")
        linears = sum(isinstance(module, torch.nn.Linear) for module in lm.model.modules())
        assert calls == 3 * linears  # the prompt's feed makes the first token; three steps the others


@pytest.mark.compile
def test_a_trusted_step_meeting_other_inputs_recompiles_once_instead_of_failing():
    """After its first call a step skips dynamo's guards. Seen failing with 'Recompilation triggered with
    skip_guard_eval_unsafe stance': a cache made outside inference mode (speculative's target-only timing) and a
    beam's strided token view. Both now meet the graph as compiled; inputs that still differ (int32 ids) make one
    counted recompile, and that step checks its guards from then on. One shape, compiled once (about 20 s)."""
    from runner.infer.loading.models import load_model
    from tests.conftest import TINY_LLAMA

    lm = load_model(config=TINY_LLAMA, device="cpu", seed=2)
    compiled.ENGINES_BY_MODEL[lm.model] = CompiledEngine(lm.model, native=False)  # the graph's guards are tested
    breaks = _graph_breaks()
    prompts = PROMPTS[:2]
    eager, _ = _generate(lm, prompts, "eager", max_new_tokens=6, temperature=0)
    ours, _ = _generate(lm, prompts, "compiled", max_new_tokens=6, temperature=0)
    engine = compiled.engine_for(lm.model)
    assert torch.equal(ours, eager) and engine.trusted and engine.stats.recompiles == 0
    assert not _graph_breaks() - breaks, list(_graph_breaks() - breaks)  # the step is one whole graph
    state = engine.state(None, 2, 16, 2048, slot="other")  # a new cache, made outside inference mode
    enc = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        logits, _ = state.prefill(lm.model, enc.input_ids, enc.attention_mask)
        token = torch.stack([logits.argmax(-1)] * 3, dim=1)[:, 0]  # [2] with stride 3, as BeamSearch.next_tokens
        assert not token.is_contiguous()
        state.feed(lm.model, token, torch.ones(2, dtype=torch.long))
        assert engine.stats.recompiles == 0
        (key,) = engine.trusted
        state.feed(lm.model, token.int(), torch.ones(2, dtype=torch.long))  # int32 ids: not what was compiled
        assert engine.stats.recompiles == 1 and key in engine.guarded and key not in engine.trusted
        state.feed(lm.model, token, torch.ones(2, dtype=torch.long))  # the int64 graph, chosen by its guards
    assert engine.stats.recompiles == 1


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["q4_0", "kivi2:g32:r32:s4:o2:b64:nuq"])
def test_a_compiled_write_stores_the_codes_an_uncompiled_one_stores(kind):
    """One static layer fed 100 columns one at a time (a block completed every 32), once as is and once through
    torch.compile with the engine's options: every stored tensor and every K/V handed to attention bit for bit the
    same. Without `emulate_precision_casts` inductor coded against unrounded fp16 scales (12 % of kivi2's differed)."""
    options = parse_kind(kind)
    shape = dict(batch=1, heads=2, key_dim=64, value_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    if options.name == "q4_0":
        layer = StaticQuantLayer(options, length=100, **shape)
    else:
        levels = (torch.linspace(0, 1, 4).pow(1.3).half(), torch.linspace(0, 1, 4).pow(0.8).half())
        layer = StaticKiviLayer(options, length=static_length(kind, 100), **shape, levels=levels)
    twin = copy.deepcopy(layer)
    write = torch.compile(lambda lay, *a: lay.write(*a), dynamic=False, options=compile_options("default"))
    generator = torch.Generator().manual_seed(0)
    channels = torch.ones(64)
    channels[3] = 20.0  # one large key channel, as real keys have
    with torch.inference_mode():
        for column in range(100):
            keys = torch.randn(1, 2, 1, 64, generator=generator) * channels
            values = torch.randn(1, 2, 1, 64, generator=generator)
            where = (torch.tensor([column]), torch.tensor(10**6))
            plain, fused = layer.write(keys, values, *where), write(twin, keys, values, *where)
            for a, b in zip(plain, fused):
                assert torch.equal(a[..., :column + 1, :], b[..., :column + 1, :]), column
    for name in layer.TENSORS:
        assert torch.equal(getattr(layer, name), getattr(twin, name)), name


def test_input_major_weights_are_the_linear_weights_in_transposed_storage(tiny_lm):
    """Whichever shapes the timing keeps, each kept weight holds the module's values in input-major storage."""
    weights = input_major_weights(tiny_lm.model, repeats=1)
    linears = {f"{name}.weight": m.weight for name, m in tiny_lm.model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert set(weights) <= set(linears)
    for name, weight in weights.items():
        assert torch.equal(weight, linears[name]) and weight.stride() == (1, weight.shape[0])
