"""The eviction grammar after a cache kind's `+`: good spellings, their canonical round trip, bad ones said clearly
(what was expected, the closest method), and the kept counts the estimator relies on. Torch-free."""

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


def test_the_compiled_engine_refuses_eviction_in_one_place():
    reason = compiled_eviction_reason("q8_0+snapkv:0.5")
    assert "evicts tokens" in reason and compiled_serve_reason("q8_0+snapkv:0.5") == reason
    assert compiled_eviction_reason("q8_0") == "" and compiled_eviction_reason(None) == ""


def test_the_grammar_needs_no_torch():
    import runner.infer.config.eviction as module

    source = open(module.__file__).read()
    assert "import torch" not in source and "from torch" not in source and "torch" not in module.__dict__
