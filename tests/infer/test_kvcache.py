"""KV-cache kinds: quantizer error bounds, real compression, estimator == measured bytes, layer API, greedy parity."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig

from runner.infer.config import GenerateConfig
from runner.infer.decode import Generator, generate
from runner.infer.kvcache import (BLOCK, NF4_LEVELS, CastLayer, NF4Layer, Q4_0Layer, Q8_0Layer, QuantLayer,
                                  bytes_per_token, cache_bytes, dequantize, estimate_cache_bytes, make_cache, quantize)

QUANT = ["q8_0", "q4_0", "nf4"]
ALL_KINDS = [None, "fp32", "fp16", "bf16", *QUANT]
LAYERS = {"q8_0": Q8_0Layer, "q4_0": Q4_0Layer, "nf4": NF4Layer}
# |x - x̂| ≤ BOUND × absmax of the block: half a quantization step (q8_0: absmax/127/2, q4_0: absmax/7/2,
# nf4: half the widest gap between adjacent levels); plus SLACK × absmax for the fp16 rounding of the scale
# (relative 2^-11, also what a clamped code can lose) and float32 arithmetic.
BOUND = {"q8_0": 1 / 254, "q4_0": 1 / 14, "nf4": float((NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max()) / 2}
SLACK = 2**-10
CODE_FRACTION = {"q8_0": 1, "q4_0": 0.5, "nf4": 0.5}  # code bytes per (padded) value
HEAD_DIM_64 = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64: whole blocks, no padding


@pytest.fixture(scope="module")
def hd64_lm():
    from runner.infer.models import load_model

    return load_model(config=HEAD_DIM_64, device="cpu", seed=0)


def _round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    codes, scales = quantize(x, kind)
    return dequantize(codes, scales, kind, x.shape[-1], torch.float32)


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """[..., D] → [..., D]: the absmax of the 32-block each value belongs to."""
    blocks = F.pad(x.float(), (0, -x.shape[-1] % BLOCK)).unflatten(-1, (-1, BLOCK))
    return blocks.abs().amax(-1, keepdim=True).expand_as(blocks).flatten(-2)[..., :x.shape[-1]]


def _assert_within_bound(x: torch.Tensor, kind: str) -> None:
    error = (x.float() - _round_trip(x, kind)).abs()
    limit = _block_absmax(x) * (BOUND[kind] + SLACK) + 1e-12
    assert torch.all(error <= limit), f"{kind}: worst error/limit {(error / limit).max():.3f}"


# --- quantizers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 128])
def test_round_trip_error_is_within_the_stated_bound_on_normal_values(kind, head_dim):
    x = torch.randn(2, 3, 50, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 3
    _assert_within_bound(x, kind)
    assert _round_trip(x, kind).shape == x.shape


@pytest.mark.parametrize("kind", QUANT)
def test_round_trip_on_adversarial_inputs(kind):
    zeros = torch.zeros(1, 2, 3, 64)
    out = _round_trip(zeros, kind)
    assert torch.equal(out, zeros) and not out.isnan().any()  # scale 0 → 0, no NaN

    x = torch.randn(1, 2, 4, 96, generator=torch.Generator().manual_seed(1)) * 1e-2
    x[0, 1, 2, 40] = 1e4  # one huge outlier: its block loses resolution, the other blocks do not
    _assert_within_bound(x, kind)
    assert (_round_trip(x, kind)[0, 1, 2, 40] - 1e4).abs() <= 1e4 * SLACK
    others = torch.ones_like(x, dtype=torch.bool)
    others[0, 1, 2, 32:64] = False
    assert ((x - _round_trip(x, kind)).abs()[others] <= 1e-2 * 5 * (BOUND[kind] + SLACK)).all()

    x[0, 0, 0, 0] = 1e6  # beyond fp16: the scale saturates, output stays finite
    assert _round_trip(x, kind).isfinite().all()

    ragged = torch.randn(3, 1, 7, 40, generator=torch.Generator().manual_seed(2))  # 40 = one block + 8 padded
    _assert_within_bound(ragged, kind)
    codes, scales = quantize(ragged, kind)
    assert scales.shape == (3, 1, 7, 2) and codes.shape[-1] == 64 * CODE_FRACTION[kind]


@pytest.mark.parametrize("kind, dtype", [("q8_0", torch.int8), ("q4_0", torch.uint8), ("nf4", torch.uint8)])
def test_storage_is_really_compressed(kind, dtype):
    codes, scales = quantize(torch.randn(2, 4, 10, 64, dtype=torch.bfloat16), kind)
    assert codes.dtype == dtype and codes.shape == (2, 4, 10, int(64 * CODE_FRACTION[kind]))
    assert scales.dtype == torch.float16 and scales.shape == (2, 4, 10, 2)


def test_q4_codes_are_offset_nibbles_and_nf4_codes_are_the_nearest_level():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    codes, _ = quantize(x, "q4_0")
    nibbles = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)
    assert nibbles.min() >= 1 and nibbles.max() <= 15  # code + 8 with code in [-7, 7]

    codes, scales = quantize(x, "nf4")
    nibbles = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()  # [4, 256], even index = low nibble
    normalized = x.unflatten(-1, (-1, BLOCK)) / scales.float().unsqueeze(-1)
    nearest = (normalized.unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1).flatten(-2)
    assert torch.equal(nibbles, nearest)


def test_dequantize_returns_the_requested_dtype():
    x = torch.randn(1, 1, 2, 64)
    for kind in QUANT:
        codes, scales = quantize(x, kind)
        assert dequantize(codes, scales, kind, 64, torch.bfloat16).dtype == torch.bfloat16


# --- measured bytes and the estimator ---------------------------------------------------------------------------

def _fill(model, kind, batch, seq_len, decode_steps):
    """Prefill `seq_len` random tokens into a fresh cache of `kind`, then decode `decode_steps` single tokens."""
    cache = make_cache(kind, model)
    ids = torch.randint(3, 200, (batch, seq_len + decode_steps), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        model(input_ids=ids[:, :seq_len], past_key_values=cache, use_cache=True)
        for i in range(seq_len, seq_len + decode_steps):
            model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("which", ["tiny_lm", "hd64_lm"])  # head_dim 16 (padded block) and 64
def test_estimator_equals_measured_bytes(kind, which, request):
    model = request.getfixturevalue(which).model
    for batch, seq_len, steps in [(1, 1, 0), (1, 7, 0), (2, 5, 3), (3, 33, 2)]:
        cache = _fill(model, kind, batch, seq_len, steps)
        assert cache.get_seq_length() == seq_len + steps
        expected = estimate_cache_bytes(model.config, kind, batch, seq_len + steps, model.dtype)
        assert cache_bytes(cache) == expected > 0
        assert expected == batch * (seq_len + steps) * bytes_per_token(model.config, kind, model.dtype)


def test_bytes_relative_to_fp16_for_smollm2_shapes():
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                         intermediate_size=1536, vocab_size=100)
    fp16 = bytes_per_token(config, "fp16", torch.float32)
    assert fp16 == 2 * 30 * 3 * 64 * 2
    assert bytes_per_token(config, None, torch.bfloat16) == fp16
    assert bytes_per_token(config, "fp32", torch.bfloat16) == 2 * fp16
    assert bytes_per_token(config, "q8_0", torch.float32) * 128 == 68 * fp16
    assert bytes_per_token(config, "q4_0", torch.float32) * 128 == 36 * fp16
    assert bytes_per_token(config, "nf4", torch.float32) * 128 == 36 * fp16


# --- the layer API ----------------------------------------------------------------------------------------------

def _kv(batch=3, seq=9, head_dim=40, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, seq, head_dim, generator=gen).to(dtype),
            torch.randn(batch, 2, seq, head_dim + 24, generator=gen).to(dtype))  # V may have another head_dim


def _layer(kind, keys, values, chunks=(None,)):
    """A layer of `kind` fed `keys`/`values` [B,H,T,D] in chunks split at the given sequence positions."""
    layer = LAYERS[kind]()
    bounds = [0, *[c for c in chunks if c is not None], keys.shape[-2]]
    for start, end in zip(bounds, bounds[1:]):
        out = layer.update(keys[..., start:end, :], values[..., start:end, :])
    return layer, out


def _same(a: QuantLayer, b: QuantLayer) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name)) for name in QuantLayer.TENSORS)


@pytest.mark.parametrize("kind", QUANT)
def test_update_returns_the_whole_dequantized_kv_in_the_incoming_dtype(kind):
    for dtype in (torch.float32, torch.bfloat16):
        keys, values = _kv(dtype=dtype)
        layer, (k, v) = _layer(kind, keys, values, chunks=(4, 5))
        assert k.dtype == v.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
        assert torch.equal(k, _round_trip(keys, kind).to(dtype)) and torch.equal(v, _round_trip(values, kind).to(dtype))
        assert layer.keys is None and layer.values is None  # only codes + scales are held
        assert layer.get_seq_length() == 9 and layer.get_mask_sizes(1) == (10, 0)


@pytest.mark.parametrize("kind", QUANT)
def test_crop_equals_a_layer_that_never_saw_the_tokens(kind):
    keys, values = _kv()
    layer, _ = _layer(kind, keys, values, chunks=(6, 7, 8))  # prefill 6, then three single tokens
    layer.crop(-3)
    shorter, _ = _layer(kind, keys[..., :6, :], values[..., :6, :])
    assert layer.get_seq_length() == 6 and _same(layer, shorter)
    layer.crop(0)
    assert _same(layer, shorter)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)


def test_cache_crop_rolls_back_decode_steps_exactly(hd64_lm):
    model = hd64_lm.model
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(5))
    caches = [make_cache("q4_0", model) for _ in range(2)]
    with torch.no_grad():
        for cache, end in zip(caches, (12, 10)):
            model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
            for i in range(8, end):
                model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    caches[0].crop(-2)
    assert caches[0].get_seq_length() == 10 and cache_bytes(caches[0]) == cache_bytes(caches[1])
    assert all(_same(a, b) for a, b in zip(caches[0].layers, caches[1].layers))


@pytest.mark.parametrize("kind", QUANT)
def test_batch_reorder_select_and_repeat_permute_rows(kind):
    keys, values = _kv()
    for apply, rows in [(lambda layer: layer.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
                        (lambda layer: layer.batch_select_indices(torch.tensor([0, 2])), [0, 2]),
                        (lambda layer: layer.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2])]:
        layer, _ = _layer(kind, keys, values)
        apply(layer)
        assert _same(layer, _layer(kind, keys[rows], values[rows])[0])


@pytest.mark.parametrize("kind", QUANT)
def test_reset_forgets_everything(kind):
    keys, values = _kv()
    layer, _ = _layer(kind, keys, values)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0 and not layer.is_initialized
    layer.update(keys[..., :2, :], values[..., :2, :])
    assert _same(layer, _layer(kind, keys[..., :2, :], values[..., :2, :])[0])


# --- make_cache, aliases, greedy parity -------------------------------------------------------------------------

def test_make_cache_kinds_and_aliases(tiny_lm):
    model = tiny_lm.model
    assert isinstance(make_cache(None, model), DynamicCache) and isinstance(make_cache("fp32", model), DynamicCache)
    assert isinstance(make_cache("fp16", model).layers[0], CastLayer)
    assert isinstance(make_cache("q8", model).layers[0], Q8_0Layer)
    assert isinstance(make_cache("q4", model).layers[0], Q4_0Layer)
    assert isinstance(make_cache("nf4", model).layers[0], NF4Layer)
    assert len(make_cache("q8_0", model).layers) == model.config.num_hidden_layers
    assert bytes_per_token(model.config, "q8", model.dtype) == bytes_per_token(model.config, "q8_0", model.dtype)
    assert bytes_per_token(model.config, "q4", model.dtype) == bytes_per_token(model.config, "q4_0", model.dtype)
    with pytest.raises(ValueError, match="unknown cache kind"):
        make_cache("q2", model)


@pytest.mark.parametrize("kind", ["q8_0", "q4", "nf4"])
@pytest.mark.parametrize("prompts", [["hello world, this is"], ["The quick brown fox", "a"]])
def test_greedy_matches_transformers_with_the_same_quantized_cache(tiny_lm, kind, prompts):
    enc = tiny_lm.tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(prompts) == 1 or (enc.attention_mask == 0).any()  # the batch of 2 is really left-padded
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=16, temperature=0, cache_kind=kind))
    ours = gen.generate(enc.input_ids, enc.attention_mask)
    assert isinstance(gen.cache.layers[0], QuantLayer)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=16, do_sample=False,
                                past_key_values=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


def test_quantized_cache_works_for_a_whole_block_head_dim_and_beam_search(hd64_lm):
    enc = hd64_lm.tokenizer(["The quick brown fox", "a"], return_tensors="pt", padding=True)
    ours = generate(hd64_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=12,
                    temperature=0, cache_kind="q8_0")
    hf = hd64_lm.model.generate(**enc, max_new_tokens=12, do_sample=False,
                                past_key_values=make_cache("q8_0", hd64_lm.model))
    assert torch.equal(ours, hf)
    beams = hd64_lm.model.generate(**enc, max_new_tokens=6, do_sample=False, num_beams=3,
                                   past_key_values=make_cache("nf4", hd64_lm.model))
    assert beams.shape == (2, enc.input_ids.shape[1] + 6)
