"""The cache-kind registry: one entry per kind, one frozen options object per kind however it is spelled, and each
entry's estimator equal to the bytes its eager and static layers hold, its formats those its static layer hands the
kernel."""

import dataclasses

import pytest

from runner.infer.cache.layers import CastLayer, KiviLayer, QuantLayer, cache_bytes
from runner.infer.cache.registry import KINDS, estimate_cache_bytes, native
from runner.infer.cache.sizes import BlockSizes, FloatSizes, KiviSizes, dims
from runner.infer.cache.static.cache import make_static_cache
from runner.infer.cache.static.kivi import StaticKiviLayer
from runner.infer.cache.static.plain import StaticPlainLayer, StaticQuantLayer
from runner.infer.config.kinds import FAMILIES, KIND_NAMES, KindOptions, canonical_kind, parse_kind
from runner.infer.kernels.cpu_attention import FORMATS
from tests.infer.cache.test_layers import FILLS, _fill

FAMILY_CLASSES = {"float": (CastLayer, StaticPlainLayer, FloatSizes),
                  "block": (QuantLayer, StaticQuantLayer, BlockSizes),
                  "kivi": (KiviLayer, StaticKiviLayer, KiviSizes)}
KINDS_AND_OPTIONS = [*KIND_NAMES, "kivi3:k4v2:g8:r16:s3:o1:b16"]


def test_every_kind_has_exactly_one_entry():
    assert list(KINDS) == list(KIND_NAMES) == list(FAMILIES)
    eager = [entry.eager for entry in KINDS.values()]
    assert len(set(eager)) == len(eager)  # no eager class stands for two kinds
    for name, entry in KINDS.items():
        base, static, sizes = FAMILY_CLASSES[parse_kind(name).family]
        assert issubclass(entry.eager, base) and entry.static is static and entry.sizes is sizes, name
        assert len(entry.formats) == 2 and set(entry.formats) <= set(FORMATS), name


@pytest.mark.parametrize("spellings", [
    ("kivi4", "kivi4:g32:r32", "kivi4:r32:g32", "kivi4:k4v4:b32:s0:o0"),
    ("q4", "q4_0"),
    ("q8", "q8_0"),
    ("kivi3", "kivi3:k3v3:b32"),
    ("kivi3:nuq:rot:o1:s4:r128:g64", "kivi3:g64:r128:s4:o1:rot:nuq", "kivi3:g64:r128:s4:o1.0:rot:nuq"),
    ("kivi2:k3v2:g64", "kivi2:g64:r64:k3v2"),
])
def test_equivalent_spellings_parse_to_one_frozen_options_object(spellings):
    options = {parse_kind(spelling) for spelling in spellings}
    assert len(options) == 1  # equal, and equally hashed
    (one,) = options
    assert parse_kind(one.canonical) == one and {canonical_kind(s) for s in spellings} == {one.canonical}
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.sinks = 4
    assert parse_kind("kivi4") != parse_kind("kivi4:g64") and parse_kind("kivi4") != parse_kind("kivi3")


def test_options_built_directly_are_checked_as_parsed_ones():
    assert KindOptions("kivi4") == parse_kind("kivi4") and KindOptions("nf4") == parse_kind("nf4")
    assert KindOptions("kivi2", group_size=16, residual_len=48) == parse_kind("kivi2:g16:r48")
    with pytest.raises(ValueError, match="takes no options"):
        KindOptions("q8_0", group_size=32)
    with pytest.raises(ValueError, match="unknown cache kind"):
        KindOptions("q4")  # aliases belong to the grammar: options always hold the canonical name
    with pytest.raises(ValueError, match="residual length"):
        KindOptions("kivi2", group_size=16, residual_len=24)


@pytest.mark.parametrize("kind", KINDS_AND_OPTIONS)
def test_each_entry_estimates_the_bytes_its_eager_layers_hold(kind, tiny_lm):
    model, options = tiny_lm.model, parse_kind(kind)
    entry = KINDS[options.name]
    for batch, seq_len, steps in FILLS:
        cache = _fill(model, kind, batch, seq_len, steps)
        assert native(options, model.dtype) or all(type(layer) is entry.eager for layer in cache.layers)
        held = entry.sizes.held(options, dims(model.config), batch, seq_len + steps, model.dtype)
        assert cache_bytes(cache) == held > 0


@pytest.mark.parametrize("kind", KINDS_AND_OPTIONS)
def test_each_entry_estimates_its_static_layers_and_names_their_kernel_formats(kind, tiny_lm):
    """A static cache holds the estimate at all its columns, plus KIVI's ring of 2r full-precision columns
    (test_static.py); its layers hand the kernel the entry's formats."""
    model, options = tiny_lm.model, parse_kind(kind)
    entry = KINDS[options.name]
    cache = make_static_cache(kind, model, 2, 40)
    assert all(type(layer) is entry.static for layer in cache.layers)
    assert all(tuple(side.format for side in layer.sides()) == entry.formats for layer in cache.layers)
    layers, heads, head_dim = dims(model.config)
    ring = 2 * options.residual_len if options.family == "kivi" else 0
    ring_bytes = 2 * layers * heads * 2 * head_dim * ring * model.dtype.itemsize
    estimate = entry.sizes.held(options, dims(model.config), 2, cache.length, model.dtype)
    assert cache_bytes(cache) == estimate + ring_bytes


@pytest.mark.parametrize("kind", KINDS_AND_OPTIONS)
@pytest.mark.parametrize("eviction", ["snapkv:0.5:w4", "knorm:0.3:e5", "streaming:0.75:s2"])
def test_each_entry_estimates_the_bytes_its_evicting_layers_hold(kind, eviction, tiny_lm):
    """With eviction, seq_len counts every token fed and prompt_len the prompt's: the estimate is the kept prompt
    (and the schedule's decoded tokens) at the kind's rate, equal to what the layers hold."""
    model, spelled = tiny_lm.model, f"{kind}+{eviction}"
    options = parse_kind(spelled)
    for batch, seq_len, steps in FILLS:
        if seq_len < 2:  # a one-token forward is a decode step: nothing to evict
            continue
        cache = _fill(model, spelled, batch, seq_len, steps)
        held = options.eviction.held(seq_len, steps)
        assert cache.get_seq_length() == held < seq_len + steps
        estimate = estimate_cache_bytes(model.config, spelled, batch, seq_len + steps, model.dtype, prompt_len=seq_len)
        assert cache_bytes(cache) == estimate == estimate_cache_bytes(model.config, kind, batch, held, model.dtype)
