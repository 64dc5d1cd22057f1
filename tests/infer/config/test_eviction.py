"""The eviction grammar after a cache kind's `+`: good spellings, their canonical round trip, bad ones said clearly
(what was expected, the closest method), and the kept counts the estimator relies on. Torch-free."""

import re

import pytest

from runner.infer.config.eviction import EvictionOptions, compiled_eviction_reason, parse_eviction
from runner.infer.config.kinds import canonical_kind, compiled_serve_reason, parse_kind, seq_len_problem


@pytest.mark.parametrize("kind, name, method, ratio, sinks, window, every, canonical", [
    ("q8_0+snapkv:0.5", "q8_0", "snapkv", 0.5, 0, 64, 0, "q8_0+snapkv:0.5"),
    ("fp16+streaming:0.75:s4:w64", "fp16", "streaming", 0.75, 4, 64, 0, "fp16+streaming:0.75:w64"),
    ("kivi4:g32:r32+knorm:0.5", "kivi4", "knorm", 0.5, 0, 0, 0, "kivi4:g32:r32+knorm:0.5"),
    ("kivi4+knorm:0.5", "kivi4", "knorm", 0.5, 0, 0, 0, "kivi4:g32:r32+knorm:0.5"),
    ("q4+snapkv:0.50:e16:w32", "q4_0", "snapkv", 0.5, 0, 32, 16, "q4_0+snapkv:0.5:w32:e16"),
    ("q4_1+expected:0.25:s0", "q4_1", "expected", 0.25, 0, 0, 0, "q4_1+expected:0.25:s0"),
    ("nf4+tova:0.9", "nf4", "tova", 0.9, 0, 1, 0, "nf4+tova:0.9"),
    ("bf16+h2o:0.3:e8", "bf16", "h2o", 0.3, 0, 0, 8, "bf16+h2o:0.3:e8"),
])
def test_good_spellings_parse_and_spell_back(kind, name, method, ratio, sinks, window, every, canonical):
    options = parse_kind(kind)
    evict = options.eviction
    assert (options.name, evict.method, evict.ratio, evict.sinks, evict.window, evict.every) == (
        name, method, ratio, sinks, window, every)
    assert options.canonical == canonical_kind(kind) == canonical
    assert parse_kind(canonical) == options and hash(parse_kind(canonical)) == hash(options)
    assert parse_kind(name).eviction is None and parse_kind(name) != options  # cache plans key on canonical


def test_the_kind_part_keeps_its_own_options_and_checks():
    options = parse_kind("kivi3:g64:r128:s4:nuq+snapkv:0.5")
    assert options.kivi.group_size == 64 and options.sinks == 4 and options.nuq
    assert options.eviction == EvictionOptions("snapkv", 0.5)
    with pytest.raises(ValueError, match="residual length"):
        parse_kind("kivi2:g16:r24+snapkv:0.5")
    assert seq_len_problem("kivi4:r64+knorm:0.5", 32) is not None  # the r of the kind, not of the eviction
    assert seq_len_problem("kivi4+knorm:0.5:w9999", 32) is None


@pytest.mark.parametrize("kind, message", [
    ("q8_0+snapvk:0.5", "did you mean 'snapkv'"),
    ("q8_0+stream:0.5", "did you mean 'streaming'"),
    ("q8_0+H2O:0.5", "did you mean 'h2o'"),
    ("q8_0+snapkv", "names no ratio"),
    ("q8_0+snapkv:half", "not a number"),
    ("q8_0+snapkv:0", r"outside the open interval \(0, 1\)"),
    ("q8_0+snapkv:1", r"outside the open interval \(0, 1\)"),
    ("q8_0+snapkv:1.5", r"outside the open interval \(0, 1\)"),
    ("q8_0+snapkv:-0.2", r"outside the open interval \(0, 1\)"),
    ("q8_0+snapkv:nan", r"outside the open interval \(0, 1\)"),
    ("q8_0+snapkv:0.5:x4", "bad eviction option 'x4'"),
    ("q8_0+snapkv:0.5:s", "bad eviction option 's'"),
    ("q8_0+snapkv:0.5:w-1", "bad eviction option 'w-1'"),
    ("q8_0+snapkv:0.5:s4:s8", "twice"),
    ("q8_0+snapkv:0.5:e99999999999999999", "between 0 and"),
    ("q8_0+snapkv:0.5+knorm:0.5", "not a number"),
    ("q9+snapkv:0.5", "unknown cache kind"),
    ("q8_0+", "unknown eviction method ''"),
])
def test_bad_spellings_say_what_was_expected(kind, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_kind(kind)
    if "method" in message or "option" in message or "ratio" in message:
        assert "<method>:<ratio" in str(error.value)


def test_options_built_directly_are_checked():
    with pytest.raises(ValueError, match="did you mean 'knorm'"):
        EvictionOptions("knrom", 0.5)
    with pytest.raises(ValueError, match=r"open interval \(0, 1\)"):
        EvictionOptions("knorm", 1.0)
    assert EvictionOptions("streaming", 0.5) == parse_eviction("streaming:0.5:s4")


@pytest.mark.parametrize("ratio, tokens, kept", [(0.5, 10, 5), (0.5, 11, 6), (0.3, 10, 7), (0.29, 100, 71),
                                                 (0.7, 10, 3), (0.99, 10, 1), (0.999, 3, 1), (0.5, 0, 0)])
def test_kept_is_the_ceiling_of_what_stays_exactly(ratio, tokens, kept):
    assert EvictionOptions("knorm", ratio).kept(tokens) == kept


def test_held_counts_the_schedule():
    plain, scheduled = EvictionOptions("knorm", 0.5), EvictionOptions("knorm", 0.5, every=4)
    assert [plain.held(10, g) for g in (0, 3, 4, 9)] == [5, 8, 9, 14]
    assert [scheduled.held(10, g) for g in (0, 3, 4, 9)] == [5, 8, 5, 6]


@pytest.mark.parametrize("kind", ["fp32+knorm:0.5", "fp16+streaming:0.75:s4:w64", "bf16+tova:0.5", "q8_0+snapkv:0.5",
                                  "q4_0+h2o:0.3", "q4_1+expected:0.5", "nf4+knorm:0.5:s2"])
def test_the_compiled_engine_evicts_float_and_block_kinds_at_prefill(kind):
    assert compiled_eviction_reason(kind) == ""
    assert compiled_eviction_reason(None) == "" and compiled_eviction_reason("q8_0") == ""


@pytest.mark.parametrize("kind, use, prefill, words", [
    ("kivi4+knorm:0.5", "decode", "eager", "KIVI cache: the compiled engine's static KIVI layout codes keys"),
    ("kivi2:g16:r32:s2+snapkv:0.5", "decode", "eager", "ring indexed by column"),
    ("q4_0+snapkv:0.5:e16", "decode", "eager", r"on a decoding schedule \(e16\): the compiled engine compacts"),
    ("q8_0+snapkv:0.5", "serve", "eager", "continuous-batching server's rows share one column pointer"),
    ("q8_0+snapkv:0.5", "decode", "compiled", "prefill: compiled feeds the prompt in pieces"),
    ("q8_0+snapkv:0.5", "speculative", "eager", "speculative decoding verifies chunks of draft tokens"),
])
def test_what_the_compiled_engine_cannot_evict_is_refused_in_one_place_saying_why(kind, use, prefill, words):
    reason = compiled_eviction_reason(kind, use, prefill)
    assert re.search(words, reason) and reason.startswith(f"cache kind {kind!r} evicts tokens"), reason
    if use == "serve":
        assert compiled_serve_reason(kind) == reason


def test_the_refusals_reach_the_configs():
    from pydantic import ValidationError

    from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig

    GenerateConfig(cache_kind="q8_0+snapkv:0.5", engine="compiled")
    for settings, words in (({"cache_kind": "kivi4+snapkv:0.5"}, "KIVI"),
                            ({"cache_kind": "q8_0+snapkv:0.5:e4"}, "decoding schedule"),
                            ({"cache_kind": "q8_0+snapkv:0.5", "prefill": "compiled"}, "prefill: compiled")):
        with pytest.raises(ValidationError, match=words):
            GenerateConfig(engine="compiled", **settings)
        GenerateConfig(engine="eager", **{k: v for k, v in settings.items() if k != "prefill"})
    for engine in ("eager", "compiled"):
        with pytest.raises(ValidationError, match="speculative decoding verifies chunks"):
            SpeculativeConfig(cache_kind="q8_0+knorm:0.5", engine=engine)


def test_the_grammar_needs_no_torch():
    import runner.infer.config.eviction as module

    source = open(module.__file__).read()
    assert "import torch" not in source and "from torch" not in source and "torch" not in module.__dict__
