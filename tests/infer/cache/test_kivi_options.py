"""kivi3 and the KIVI options (sinks, outliers, rotation, nuq) in the cache: measured = estimated bytes, crop,
reorder and batches, parity with transformers' generate, and the quality they buy on a small model."""

import json

import pytest
import torch

from runner.infer.cache import codebooks
from runner.infer.cache.layers import KiviLayer, cache_bytes
from runner.infer.cache.registry import KINDS, bytes_per_token, estimate_cache_bytes, make_cache, residual_bytes
from runner.infer.config.kinds import canonical_kind, parse_kind
from runner.infer.loading.texts import load_text
from runner.infer.measure.quality import build_probe, compare, run_probe
from tests.infer.cache.test_layers import FILLS, HEAD_DIM_64, SMOLLM2, _fill, _kv, _same


@pytest.fixture(scope="module")
def hd64_lm():
    from runner.infer.loading.models import load_model

    return load_model(config=HEAD_DIM_64, device="cpu", seed=0)


@pytest.fixture(autouse=True)
def _codebooks_in_tmp(tmp_path, monkeypatch):
    """nuq codes are fitted into a fresh cache directory, not ~/.cache/runner."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(codebooks, "_FITTED", {})


def _layer(kind, keys, values, chunks=()):
    options = parse_kind(kind)
    levels = tuple(torch.linspace(0, 1, 2 ** bits).half() for bits in (options.key_bits, options.value_bits))
    layer = KINDS[options.name].eager(options, levels=levels if options.nuq else None)
    bounds = [0, *chunks, keys.shape[-2]]
    for start, end in zip(bounds, bounds[1:]):
        out = layer.update(keys[..., start:end, :], values[..., start:end, :])
    return layer, out


@pytest.mark.parametrize("kind, levels", [("kivi3:g8:r16:s5:o1:rot:nuq", 8 + 8), ("kivi2:nuq", 4 + 4),
                                          ("kivi3:k4v2:g8:r16:s3:o1:b16:nuq", 16 + 4), ("kivi2:k3v2:b64:nuq", 8 + 4)])
def test_estimator_equals_measured_bytes_with_fitted_codes(kind, levels, hd64_lm):
    model = hd64_lm.model  # the other options: test_kvcache, and the split widths below
    for batch, seq_len, steps in FILLS[::2]:
        cache = _fill(model, kind, batch, seq_len, steps)
        assert cache_bytes(cache) == estimate_cache_bytes(model.config, kind, batch, seq_len + steps, model.dtype) > 0
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.levels)
        assert held == 2 * levels * 2  # 2 layers × (K levels + V levels) × fp16


@pytest.mark.parametrize("kind", ["kivi3:k4v2", "kivi3:k4v3:g16:r48:s3:o1", "kivi2:k3v2:g8:r16:b64:rotv",
                                  "kivi4:b16", "kivi3:k2v4:b64:s2"])
def test_estimator_equals_measured_bytes_with_split_widths_and_value_blocks(kind, hd64_lm, tiny_lm):
    for model in (hd64_lm.model, tiny_lm.model):  # head_dim 64 and 16 (b64, b32 and b16: a ragged, padded block)
        for batch, seq_len, steps in FILLS:
            cache = _fill(model, kind, batch, seq_len, steps)
            assert cache_bytes(cache) == estimate_cache_bytes(model.config, kind, batch, seq_len + steps, model.dtype)


def test_bytes_of_the_options_for_smollm2_shapes():
    fp16 = bytes_per_token(SMOLLM2, "fp16", torch.float32)  # 2·30·3·64·2
    assert bytes_per_token(SMOLLM2, "kivi3", torch.float32) == 30 * 3 * (24 + 8 + 24 + 8) == 0.25 * fp16
    assert bytes_per_token(SMOLLM2, "kivi3:g64:r128", torch.float32) == 30 * 3 * (24 + 4 + 24 + 8)
    # 1 % of 64 tokens × 64 values = 41 outliers per side and chunk, 2 bytes of value + 2 of index each
    assert bytes_per_token(SMOLLM2, "kivi3:g64:r128:o1", torch.float32) == 30 * 3 * (60 + 2 * 41 * 4 / 64)
    # sinks (fp32 here), and the codebooks (30 layers × K, V × 8 fp16 levels) are fixed costs, counted once
    plain = estimate_cache_bytes(SMOLLM2, "kivi3:g64:r128", 1, 4 + 1024, torch.float32)
    sinks = estimate_cache_bytes(SMOLLM2, "kivi3:g64:r128:s4", 1, 4 + 1024, torch.float32)
    assert sinks - estimate_cache_bytes(SMOLLM2, "kivi3:g64:r128", 1, 1024, torch.float32) == 30 * 3 * 4 * 2 * 64 * 4
    assert plain == sinks  # without sinks those 4 full-precision tokens wait in the residual instead
    assert residual_bytes(SMOLLM2, "kivi3:g64:r128", 1, 4 + 1024, torch.float32) == 30 * 3 * 2 * 64 * 4 * 4
    assert residual_bytes(SMOLLM2, "kivi3:g64:r128:s4", 1, 4 + 1024, torch.float32) == 0
    assert estimate_cache_bytes(SMOLLM2, "kivi3:g64:r128:nuq", 2, 1024, torch.float32) == estimate_cache_bytes(
        SMOLLM2, "kivi3:g64:r128", 2, 1024, torch.float32) + 30 * 2 * 8 * 2
    assert residual_bytes(SMOLLM2, "kivi3:g64:r128:s4", 1, 4 + 1000, torch.float32) == 30 * 3 * 2 * 64 * 104 * 4
    # keys at 4 bits (32 + 8), values at 2 (16 + 8): kivi3's bytes; values in one block of 64: 16 + 4
    assert bytes_per_token(SMOLLM2, "kivi3:k4v2", torch.float32) == 30 * 3 * (32 + 8 + 16 + 8) == 0.25 * fp16
    assert bytes_per_token(SMOLLM2, "kivi2:k3v2:g128:b64", torch.float32) == 30 * 3 * (24 + 2 + 16 + 4)
    assert estimate_cache_bytes(SMOLLM2, "kivi3:k4v2:nuq", 1, 64, torch.float32) == estimate_cache_bytes(
        SMOLLM2, "kivi3:k4v2", 1, 64, torch.float32) + 30 * (16 + 4) * 2


@pytest.mark.parametrize("kind", ["kivi3:g8:r16:s5:o2", "kivi2:g16:r32:s4:o1:rot:rotv", "kivi3:s3:nuq:rotv",
                                  "kivi3:k4v2:g8:r16:s2:o1:b16:nuq"])
def test_state_depends_only_on_the_tokens_not_the_chunking(kind):
    keys, values = _kv(seq=100, head_dim=64)
    one_go, out = _layer(kind, keys, values)
    for chunks in [(1, 2, 3, 4, 5, 31, 32, 33, 63, 64, 65, 99), (4, 40, 90)]:
        chunked, chunked_out = _layer(kind, keys, values, chunks=chunks)
        assert _same(one_go, chunked) and all(torch.equal(a, b) for a, b in zip(out, chunked_out))


@pytest.mark.parametrize("kind", ["kivi3:s4", "kivi2:g16:r32:s4:o2:rot", "kivi3:g8:r16:s2:o1:rotv:nuq",
                                  "kivi2:k3v2:g8:r16:s2:o1:b64:nuq"])
@pytest.mark.parametrize("crop", [-1, -7, -20, -38, -60, -74, -76])
def test_sinks_and_outliers_survive_crops_and_attention_sees_the_same_kv(kind, crop):
    """Crops inside the residual, across groups and into the sinks: every kept token has exactly the K/V it had,
    and the layer holds what a layer fed only the kept tokens holds."""
    keys, values = _kv(seq=77, head_dim=64)
    layer, (k, v) = _layer(kind, keys, values, chunks=(70, 71))
    keep = 77 + crop
    layer.crop(crop)
    assert layer.get_seq_length() == keep
    assert layer.sink_keys.shape[-2] == min(keep, layer.sinks)
    assert torch.equal(layer.sink_keys, keys[..., :min(keep, layer.sinks), :])  # exact, not quantized
    assert layer.nbytes() == _layer(kind, keys[..., :keep, :], values[..., :keep, :])[0].nbytes()
    new_k, new_v = _kv(seq=1, seed=1, head_dim=64)
    quantized = layer.quantized_len()
    after_k, after_v = layer.update(new_k, new_v)
    if layer.quantized_len() == quantized:  # no flush: a flush quantizes the dequantized tokens again (as KIVI's)
        assert torch.equal(after_k[..., :keep, :], k[..., :keep, :])
        assert torch.equal(after_v[..., :keep, :], v[..., :keep, :])


@pytest.mark.parametrize("kind", ["kivi3:s4:o1", "kivi2:s3:o2:rot:rotv", "kivi3:k4v2:s4:o1:b64"])
def test_batch_reorder_select_and_repeat_permute_sinks_and_outliers(kind):
    keys, values = _kv(seq=45, head_dim=64)  # 4 sinks, 32 quantized, 9 residual
    for apply, rows in [(lambda layer: layer.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
                        (lambda layer: layer.batch_select_indices(torch.tensor([0, 2])), [0, 2]),
                        (lambda layer: layer.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2])]:
        layer, _ = _layer(kind, keys, values)
        assert layer.key_outliers.shape[-1] > 0 and layer.quantized_len() == 32
        apply(layer)
        assert _same(layer, _layer(kind, keys[rows], values[rows])[0])


def test_sinks_are_exact_and_outliers_come_back_exact_in_fp16():
    keys, values = _kv(batch=1, seq=40, head_dim=64)
    keys[0, 1, 10, 3] = 40.0  # a planted outlier in the first quantized group
    layer, (k, v) = _layer("kivi3:s4:o1", keys, values)
    assert torch.equal(k[..., :4, :], keys[..., :4, :]) and torch.equal(v[..., :4, :], values[..., :4, :])
    assert k[0, 1, 10, 3] == 40.0 and layer.quantized_len() == 32
    assert layer.key_outlier_index.dtype == torch.int16 and layer.key_outliers.shape == (1, 2, 1, 20)


def test_rotation_alone_round_trips_through_the_layer_within_the_rotated_bound():
    """Rotated codes come back rotated back: the error is a quantization error, not a different basis."""
    keys, values = _kv(batch=1, seq=64, head_dim=64)
    plain, (k0, v0) = _layer("kivi4", keys, values)
    rotated, (k1, v1) = _layer("kivi4:rot:rotv", keys, values)
    for got, want in ((k0, keys), (k1, keys), (v0, values), (v1, values)):
        assert (got - want).abs().mean() < 0.15 * want.abs().mean()


def test_split_widths_code_each_side_exactly_as_the_kind_of_that_width_does():
    """k4v2: the keys of kivi4 and the values of kivi2, bit for bit; b64: values coded in blocks of 64 channels,
    a coarser step than blocks of 32 but within the 2-bit bound of a block's range."""
    keys, values = _kv(batch=1, seq=64, head_dim=64)
    values = values[..., :64]
    _, (k4, v4) = _layer("kivi4", keys, values)
    _, (k2, v2) = _layer("kivi2", keys, values)
    split, (k, v) = _layer("kivi3:k4v2", keys, values)
    assert torch.equal(k, k4) and torch.equal(v, v2) and not torch.equal(k, k2)
    assert split.key_codes.shape[-2] == 64 * 4 // 8 and split.value_codes.shape[-1] == 64 * 2 // 8
    _, (_, v64) = _layer("kivi2:b64", keys, values)
    for got in (v2, v64):  # asymmetric 2 bits: at most half a step, a step = range / 3
        blocks = values.unflatten(-1, (-1, 32 if got is v2 else 64))
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 3
        assert ((got.unflatten(-1, blocks.shape[-2:]) - blocks).abs() <= step / 2 + 1e-3).all()
    assert (v64 - values).abs().mean() > (v2 - values).abs().mean()


def test_kind_strings_name_their_options_and_one_spelling():
    assert canonical_kind("kivi3") == "kivi3:g32:r32"
    assert canonical_kind("kivi3:nuq:rot:o1:s4:r128:g64") == "kivi3:g64:r128:s4:o1:rot:nuq"
    assert canonical_kind("kivi2:o0.5:rotv") == "kivi2:g32:r32:o0.5:rotv"
    assert parse_kind("kivi3:s4").sinks == 4 and parse_kind("kivi3:o1.5").outlier_percent == 1.5
    assert canonical_kind("kivi3:k4v2:b64:s4:nuq") == "kivi3:g32:r32:s4:b64:k4v2:nuq"
    assert canonical_kind("kivi3:k3v3:b32") == "kivi3:g32:r32"  # the defaults spelled out are the defaults
    assert parse_kind("kivi2:k3v2").key_bits == 3 and parse_kind("kivi3").value_bits == 3


@pytest.mark.parametrize("kind, message", [
    ("kivi3:g4", "positive multiple of 8 at 3 bits"),
    ("kivi3:rto", "did you mean 'rot'"),
    ("kivi3:nuqq", "did you mean 'nuq'"),
    ("kivi4:o60", "between 0 and 50"),
    ("kivi4:s4:s8", "gives option 's' twice \\(s4, then s8\\)"),
    ("kivi4:g99999999999999999999999", "far beyond what a cache holds \\(group_size at most 10,000,000\\)"),
    ("kivi2:b1000000", "value_block at most 4,096"),
    ("kivi2:o1.x", "bad option 'o1.x'"),
    ("kivi3:rot:rot", "gives option 'rot' twice"),
    ("kivi5", "did you mean"),
    ("kivi3:k4v4", "average 4: kivi3 takes splits whose average rounds down to 3"),
    ("kivi3:k2v2", "average 2"),
    ("kivi2:k3v2:g4", "positive multiple of 8 at 3 bits"),  # keys are packed along the tokens of a group
    ("kivi3:b12", "value block \\(b\\) must be a positive multiple of 8 at 3 bits"),
    ("kivi3:k5v1", "bad option 'k5v1'"),
])
def test_bad_options_are_rejected_with_the_closest_valid_one(kind, message):
    with pytest.raises(ValueError, match=message):
        parse_kind(kind)


def test_token_counts_past_max_seq_len_are_named_before_any_cache_is_made():
    from runner.infer.config.kinds import seq_len_problem

    assert "4096 sink tokens (s4096) leave no room in max_seq_len 2048" in seq_len_problem("kivi4:s4096", 2048)
    assert "residual window r256 is longer than max_seq_len 128" in seq_len_problem("kivi2:g128:r256", 128)
    assert seq_len_problem("kivi4:g32:r128:s4", 128) is None and seq_len_problem("q8_0", 1) is None
    assert seq_len_problem("auto", 1) is None and seq_len_problem(None, 1) is None


def test_nuq_needs_levels_and_a_model_load_model_made(tiny_lm):
    with pytest.raises(ValueError, match="make_cache"):
        KiviLayer(parse_kind("kivi4:nuq"))
    from transformers import AutoModelForCausalLM, LlamaConfig

    bare = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=2, vocab_size=300))
    from runner.errors import InferenceError

    with pytest.raises(InferenceError, match="load_model"):
        make_cache("kivi3:nuq", bare)


def test_nuq_codes_are_fitted_once_per_model_and_options_and_cached_on_disk(hd64_lm, tmp_path, monkeypatch):
    cache = make_cache("kivi3:g16:r16:nuq", hd64_lm.model)
    files = list((tmp_path / "codebooks").glob("*.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())["levels"]) == 2  # two layers
    levels = cache.layers[0].levels
    assert levels[0].dtype == torch.float16 and levels[0].shape == (8,) and not torch.equal(levels[0], levels[1])
    assert torch.all(levels[0][1:] > levels[0][:-1])
    monkeypatch.setattr(codebooks, "_FITTED", {})
    monkeypatch.setattr(codebooks, "fit_model_levels", lambda *a: pytest.fail("fitted again: not read from disk"))
    again = make_cache("kivi3:g16:r16:nuq", hd64_lm.model)
    assert torch.equal(again.layers[1].levels[1], cache.layers[1].levels[1])
    make_cache("kivi3:g16:r16:nuq", hd64_lm.model)  # in-process too
    monkeypatch.undo()
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    make_cache("kivi3:g16:r16:s4:nuq", hd64_lm.model)  # other options: another fit, another file
    assert len(list((tmp_path / "codebooks").glob("*.json"))) == 2


@pytest.mark.parametrize("kind", ["kivi3:s4:o1", "kivi2:g8:r16:s4:o2:rot:rotv", "kivi3:g8:r16:nuq",
                                  "kivi3:k4v2:g8:r16:b16:nuq"])
def test_greedy_matches_transformers_with_the_options(tiny_lm, kind):
    from runner.infer.config.decoding import GenerateConfig
    from runner.infer.decode.forward import DecodeState
    from runner.infer.generation.generator import Generator

    enc = tiny_lm.tokenizer(["The quick brown fox", "a"], return_tensors="pt", padding=True)
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=24, temperature=0))
    gen.state = DecodeState(make_cache(kind, tiny_lm.model))
    ours = gen.generate(enc.input_ids, enc.attention_mask)
    assert gen.cache.get_seq_length() > 32
    hf = tiny_lm.model.generate(**enc, max_new_tokens=24, do_sample=False,
                                cache=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


def test_sinks_and_outliers_beat_plain_kivi2_on_kl_on_real_text(hd64_lm):
    probe = build_probe(hd64_lm.tokenizer, load_text("pydoc"), prompt_len=96, decode_steps=16, windows=4,
                        ppl_len=192, device=torch.device("cpu"))
    reference = run_probe(hd64_lm.model, probe, None)
    kl = {kind: compare(reference, run_probe(hd64_lm.model, probe, kind))["mean_kl"]
          for kind in ("kivi2", "kivi2:s4:o2", "kivi3")}
    assert 0 < kl["kivi2:s4:o2"] < kl["kivi2"] * 0.8, kl
    assert kl["kivi3"] < kl["kivi2"], kl
