"""KV-cache kinds: quantizer error bounds, real compression, estimator == measured bytes, layer API, greedy parity."""

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig

from runner.infer.cache.layers import (
    CastLayer,
    Kivi2Layer,
    Kivi4Layer,
    KiviLayer,
    NF4Layer,
    Q4_0Layer,
    Q4_1Layer,
    Q8_0Layer,
    QuantLayer,
    cache_bytes,
)
from runner.infer.cache.registry import bytes_per_token, estimate_cache_bytes, make_cache, residual_bytes
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import KindOptions, parse_kind
from runner.infer.decode.forward import DecodeState
from runner.infer.generation.generator import Generator, generate
from runner.infer.loading.texts import load_text
from runner.infer.measure.quality import build_probe, compare, run_probe
from runner.infer.quant.formats import (
    BLOCK,
    NF4_LEVELS,
    dequantize,
    dequantize_groups,
    pack,
    plane_bytes,
    quantize,
    quantize_groups,
    unpack,
    unpack_expr,
    unpack_into,
)

QUANT = ["q8_0", "q4_0", "nf4", "q4_1"]
KIVI = ["kivi4", "kivi2"]
KIVI_OPTIONED = ["kivi3", "kivi3:g64:r128:s4:o1", "kivi2:s4:o2:rot:rotv", "kivi4:g16:r32:s3:o0.5:rotv"]  # nuq:
ALL_KINDS = [None, "fp32", "fp16", "bf16", *QUANT, *KIVI, "kivi4:g8:r24", "kivi2:g16:r64", *KIVI_OPTIONED]  # options
LAYERS = {"q8_0": Q8_0Layer, "q4_0": Q4_0Layer, "nf4": NF4Layer, "q4_1": Q4_1Layer, "kivi4": Kivi4Layer,
          "kivi2": Kivi2Layer}
# Symmetric kinds: |x - x̂| ≤ BOUND × absmax of the block: half a quantization step (q8_0: absmax/127/2,
# q4_0: absmax/7/2, nf4: half the widest gap between adjacent levels). Asymmetric kinds (q4_1, KIVI groups):
# |x - x̂| ≤ (max - min) of the group / (2·(2^b - 1)), half a step. Plus SLACK × absmax for the fp16 rounding of
# scale and minimum (relative 2^-11, also what a clamped code can lose) and float32 arithmetic, and TINY for an
# fp16 scale that underflows.
BOUND = {"q8_0": 1 / 254, "q4_0": 1 / 14, "nf4": float((NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max()) / 2}
ASYM_BITS = {"q4_1": 4}
SLACK, TINY = 2**-10, 1e-6
CODE_FRACTION = {"q8_0": 1, "q4_0": 0.5, "nf4": 0.5, "q4_1": 0.5}  # code bytes per (padded) value
SCALES_PER_BLOCK = {"q8_0": 1, "q4_0": 1, "nf4": 1, "q4_1": 2}  # q4_1: scale and minimum
HEAD_DIM_64 = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64: whole blocks, no padding
SMOLLM2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                      intermediate_size=1536, vocab_size=100)


@pytest.fixture(scope="module")
def hd64_lm():
    from runner.infer.loading.models import load_model

    return load_model(config=HEAD_DIM_64, device="cpu", seed=0)


def _round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    codes, scales = quantize(x, kind)
    return dequantize(codes, scales, kind, x.shape[-1], torch.float32)


def _group_stat(x: torch.Tensor, group: int, stat, dim: int = -1) -> torch.Tensor:
    """x → same shape: `stat` of the zero-padded group of `group` values along `dim` each value belongs to."""
    y = x.float().movedim(dim, -1)
    groups = F.pad(y, (0, -y.shape[-1] % group)).unflatten(-1, (-1, group))
    return stat(groups).expand_as(groups).flatten(-2)[..., :y.shape[-1]].movedim(-1, dim)


def _absmax(groups):
    return groups.abs().amax(-1, keepdim=True)


def _range(groups):
    return groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)


def _group_limit(x: torch.Tensor, bits: int, group: int, dim: int = -1) -> torch.Tensor:
    """The stated bound of an asymmetric `bits`-bit group quantizer for every value of x."""
    return (_group_stat(x, group, _range, dim) / (2 * (2**bits - 1))
            + _group_stat(x, group, _absmax, dim) * SLACK + TINY)


def _assert_within_bound(x: torch.Tensor, kind: str) -> None:
    error = (x.float() - _round_trip(x, kind)).abs()
    if kind in ASYM_BITS:
        limit = _group_limit(x, ASYM_BITS[kind], BLOCK)
    else:
        limit = _group_stat(x, BLOCK, _absmax) * (BOUND[kind] + SLACK) + 1e-12
    assert torch.all(error <= limit), f"{kind}: worst error/limit {(error / limit).max():.3f}"


# --- quantizers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 128])
def test_round_trip_error_is_within_the_stated_bound_on_normal_values(kind, head_dim):
    x = torch.randn(2, 3, 50, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 3
    _assert_within_bound(x, kind)
    _assert_within_bound(x + 5, kind)  # an offset: the asymmetric kind keeps its resolution
    assert _round_trip(x, kind).shape == x.shape


def test_q4_1_is_finer_than_q4_0_on_offset_values():
    x = torch.rand(4, 8, 64, generator=torch.Generator().manual_seed(7)) + 2  # all in [2, 3): range 1, absmax 3
    q4_1 = (x - _round_trip(x, "q4_1")).abs().max()
    assert q4_1 <= 1 / 30 + 3 * SLACK and q4_1 < (x - _round_trip(x, "q4_0")).abs().max() / 4


@pytest.mark.parametrize("kind", QUANT)
def test_round_trip_on_adversarial_inputs(kind):
    zeros = torch.zeros(1, 2, 3, 64)
    out = _round_trip(zeros, kind)
    assert torch.equal(out, zeros) and not out.isnan().any()  # scale 0 → 0, no NaN
    constant = torch.full((1, 2, 3, 64), -1.5)
    _assert_within_bound(constant, kind)
    if kind in ASYM_BITS:
        assert torch.equal(_round_trip(constant, kind), constant)  # range 0: every value is the fp16 minimum

    x = torch.randn(1, 2, 4, 96, generator=torch.Generator().manual_seed(1)) * 1e-2
    x[0, 1, 2, 40] = 1e4  # one huge outlier: its block loses resolution, the other blocks do not
    _assert_within_bound(x, kind)
    assert (_round_trip(x, kind)[0, 1, 2, 40] - 1e4).abs() <= 1e4 * SLACK
    others = torch.ones_like(x, dtype=torch.bool)
    others[0, 1, 2, 32:64] = False
    assert ((x - _round_trip(x, kind)).abs()[others] <= 1e-2 * 5 * (BOUND.get(kind, 1 / 15) + SLACK)).all()

    x[0, 0, 0, 0] = 1e6  # beyond fp16: the scale saturates, output stays finite
    assert _round_trip(x, kind).isfinite().all()

    ragged = torch.randn(3, 1, 7, 40, generator=torch.Generator().manual_seed(2))  # 40 = one block + 8 padded
    _assert_within_bound(ragged, kind)
    codes, scales = quantize(ragged, kind)
    assert scales.shape == (3, 1, 7, 2 * SCALES_PER_BLOCK[kind]) and codes.shape[-1] == 64 * CODE_FRACTION[kind]


@pytest.mark.parametrize("kind, dtype", [("q8_0", torch.int8), ("q4_0", torch.uint8), ("nf4", torch.uint8),
                                         ("q4_1", torch.uint8)])
def test_storage_is_really_compressed(kind, dtype):
    codes, scales = quantize(torch.randn(2, 4, 10, 64, dtype=torch.bfloat16), kind)
    assert codes.dtype == dtype and codes.shape == (2, 4, 10, int(64 * CODE_FRACTION[kind]))
    assert scales.dtype == torch.float16 and scales.shape == (2, 4, 10, 2 * SCALES_PER_BLOCK[kind])


def test_q4_codes_are_offset_nibbles_and_nf4_codes_are_the_nearest_level():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    codes, _ = quantize(x, "q4_0")
    nibbles = unpack(codes, 4)
    assert nibbles.min() >= 1 and nibbles.max() <= 15  # code + 8 with code in [-7, 7]

    codes, scales = quantize(x, "nf4")
    nibbles = unpack(codes, 4).long()  # [4, 256]
    normalized = x.unflatten(-1, (-1, BLOCK)) / scales.float().unsqueeze(-1)
    nearest = (normalized.unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1).flatten(-2)
    assert torch.equal(nibbles, nearest)


def test_q4_1_codes_span_0_to_15_from_the_block_minimum():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    codes, params = quantize(x, "q4_1")  # params [4, 16]: (scale, min) per block
    nibbles = unpack(codes, 4).unflatten(-1, (-1, BLOCK))  # [4, 8, 32]
    assert (nibbles.amin(-1) == 0).all() and (nibbles.amax(-1) == 15).all()
    scales, mins = params.unflatten(-1, (-1, 2)).unbind(-1)
    blocks = x.unflatten(-1, (-1, BLOCK))
    assert torch.equal(mins, blocks.amin(-1).half())
    assert torch.equal(scales, ((blocks.amax(-1) - mins.float()) / 15).half())


def test_dequantize_returns_the_requested_dtype():
    x = torch.randn(1, 1, 2, 64)
    for kind in QUANT:
        codes, scales = quantize(x, kind)
        assert dequantize(codes, scales, kind, 64, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_interleaves_codes_along_other_axes_and_unpack_inverts_it(bits):
    codes = torch.randint(0, 2**bits, (3, 16, 8), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    for dim in (-1, -2, 1):
        packed = pack(codes, bits, dim=dim)
        assert packed.dtype == torch.uint8 and packed.shape[dim] * 8 // bits == codes.shape[dim]
        assert torch.equal(unpack(packed, bits, dim=dim), codes)
    first_byte = pack(codes, bits, dim=1)[0, 0, 0]
    assert int(first_byte) == sum(int(codes[0, i, 0]) << (bits * i) for i in range(8 // bits))


@pytest.mark.parametrize("bits, length, chunk", [(4, 64, 16), (2, 64, 16), (2, 32, 8), (4, 96, 16), (2, 96, 8)])
def test_pack_lays_the_last_axis_in_planes_of_chunks(bits, length, chunk):
    """Along the last axis byte j of a group of C bytes holds codes j, j + C, j + 2C, … of the group's C·8/b
    codes, the first in the lowest bits: C consecutive values are C consecutive bytes under one shift."""
    per_byte = 8 // bits
    codes = torch.randint(0, 2**bits, (5, length), generator=torch.Generator().manual_seed(length)).to(torch.uint8)
    packed = pack(codes, bits)
    assert plane_bytes(length, bits) == chunk and packed.shape == (5, length // per_byte)
    for group in range(length // (chunk * per_byte)):
        for j in range(chunk):
            byte = int(packed[2, group * chunk + j])
            first = group * chunk * per_byte + j
            assert byte == sum(int(codes[2, first + i * chunk]) << (bits * i) for i in range(per_byte))
    assert torch.equal(unpack(packed, bits), codes)
    assert torch.equal(unpack_expr(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_into_floats_agrees_on_the_plane_and_the_row_paths(bits):
    """Along the last axis unpack_into copies planes of chunks; elsewhere it copies rows. Both must give the
    codes, converted into whatever `out` is (here a strided float32 view)."""
    codes = torch.randint(0, 2**bits, (2, 3, 32, 16), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    for dim in (-1, -2):
        packed = pack(codes, bits, dim=dim)
        for source in (packed, packed.transpose(0, 1).contiguous().transpose(0, 1)):  # contiguous or not
            buffer = torch.full((2, 3, 40, 24), -1.0)
            out = unpack_into(buffer[..., 4:36, 4:20], source, bits, dim=dim)
            assert torch.equal(out, codes.float()) and out.data_ptr() == buffer[..., 4:, 4:].data_ptr()
            assert torch.all(buffer[..., :4, :] == -1) and torch.all(buffer[..., 20:] == -1)  # nothing else written


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim, group, length", [(-1, 32, 64), (-1, 32, 40), (-2, 32, 64), (-2, 8, 24)])
def test_dequantize_groups_into_a_view_equals_the_plain_result(bits, dim, group, length):
    """KIVI decodes by dequantizing into a view of the tensor attention reads: same floats as a fresh tensor, in
    float32 (written directly) and in bf16 or with padding cropped (through a float32 temporary)."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(length)) * 3 + 1
    x = x.narrow(dim, 0, length)
    quantized = quantize_groups(x, bits, group, dim=dim)
    plain = dequantize_groups(*quantized, bits, group, length, torch.float32, dim=dim)
    for dtype in (torch.float32, torch.bfloat16):
        shape = list(x.shape)
        shape[dim] += 5
        buffer = torch.zeros(shape, dtype=dtype)
        view = buffer.narrow(dim, 0, length)
        assert dequantize_groups(*quantized, bits, group, length, dtype, dim=dim, out=view) is view
        assert torch.equal(view, plain.to(dtype)) and torch.all(buffer.narrow(dim, length, 5) == 0)


def test_dequantized_values_are_one_rounding_away_from_code_times_scale_plus_minimum():
    """code·s is exact in float32 for ≤ 4-bit codes and fp16 scales, so a fused multiply-add (addcmul may be one)
    and a multiply then an add give the same floats: the dequantized value does not depend on the kernel."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4096,), generator=gen).float()
    scales = (torch.randn(4096, generator=gen) * torch.logspace(-6, 4, 4096)).half().float()
    mins = (torch.randn(4096, generator=gen) * 100).half().float()
    exact = (codes.double() * scales.double() + mins.double()).float()  # one rounding, from the exact value
    assert torch.equal(torch.addcmul(mins, codes, scales), exact) and torch.equal(codes * scales + mins, exact)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim, group", [(-1, 32), (-1, 16), (-2, 32), (-2, 8), (1, 4)])
def test_group_quantizer_error_bound_and_shapes(bits, dim, group):
    x = torch.randn(2, 3, 64, 40, generator=torch.Generator().manual_seed(group)) * 2 + 1  # 40 = ragged at 32
    x[0, 1, 5, 7] = 50.0  # an outlier costs resolution only in its own group
    codes, scales, mins = quantize_groups(x, bits, group, dim=dim)
    n, n_groups = x.shape[dim], -(-x.shape[dim] // group)
    assert codes.dtype == torch.uint8 and codes.shape[dim] == n_groups * group * bits // 8
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape[dim] == mins.shape[dim] == n_groups
    out = dequantize_groups(codes, scales, mins, bits, group, n, torch.float32, dim=dim)
    assert out.shape == x.shape
    error, limit = (x - out).abs(), _group_limit(x, bits, group, dim)
    assert torch.all(error <= limit), f"worst error/limit {(error / limit).max():.3f}"
    flat = torch.zeros(1, 1, 8, 32)
    assert torch.equal(dequantize_groups(*quantize_groups(flat, bits, 8, dim=-2), bits, 8, 8, torch.float32, dim=-2),
                       flat)


# --- measured bytes and the estimator ---------------------------------------------------------------------------

def _fill(model, kind, batch, seq_len, decode_steps):
    """Prefill `seq_len` random tokens into a fresh cache of `kind`, then decode `decode_steps` single tokens."""
    cache = make_cache(kind, model)
    ids = torch.randint(3, 200, (batch, seq_len + decode_steps), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        model(input_ids=ids[:, :seq_len], cache=cache, use_cache=True)
        for i in range(seq_len, seq_len + decode_steps):
            model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
    return cache


# (batch, prefill, decode steps): below, at and past multiples of the KIVI residual lengths (24, 32, 64),
# flushes during prefill and during decode.
FILLS = [(1, 1, 0), (1, 7, 0), (2, 5, 3), (3, 33, 2), (1, 32, 0), (2, 30, 5), (1, 64, 0), (2, 48, 24), (1, 60, 37)]


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("which", ["tiny_lm", "hd64_lm"])  # head_dim 16 (padded block) and 64
def test_estimator_equals_measured_bytes(kind, which, request):
    model = request.getfixturevalue(which).model
    for batch, seq_len, steps in FILLS:
        cache = _fill(model, kind, batch, seq_len, steps)
        total = seq_len + steps
        assert cache.get_seq_length() == total
        expected = estimate_cache_bytes(model.config, kind, batch, total, model.dtype)
        assert cache_bytes(cache) == expected > 0
        compressed = expected - residual_bytes(model.config, kind, batch, total, model.dtype)
        options = parse_kind(kind)
        if options is not None and options.family == "kivi":
            sinks = min(total, options.sinks)  # kept exact, outside the quantized and residual tokens
            quantized = (total - sinks) // options.residual_len * options.residual_len
            assert all(layer.quantized_len() == quantized for layer in cache.layers)
            token_bytes = cache_bytes(_fill(model, None, 1, 1, 0))  # one token in the model's dtype, K and V
            assert compressed == batch * (quantized * bytes_per_token(model.config, kind, model.dtype)
                                          + sinks * token_bytes)
        else:
            assert compressed == expected == batch * total * bytes_per_token(model.config, kind, model.dtype)


@pytest.mark.parametrize("kind", ["kivi4", "kivi2:g16:r64", "q4_1", "kivi3:g16:r32:s4:o1:rotv"])
def test_estimator_equals_measured_bytes_after_crops_and_more_decoding(kind, hd64_lm):
    model = hd64_lm.model
    cache = _fill(model, kind, 2, 90, 10)  # 100 tokens
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(9))
    for crop, decode in [(-3, 0), (-40, 5), (-20, 30), (-64, 1)]:
        length = cache.get_seq_length() + crop
        cache.crop(crop)
        assert cache.get_seq_length() == length
        assert cache_bytes(cache) == estimate_cache_bytes(model.config, kind, 2, length, model.dtype)
        with torch.no_grad():
            for i in range(decode):
                model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
        assert cache_bytes(cache) == estimate_cache_bytes(model.config, kind, 2, length + decode, model.dtype)


def test_bytes_relative_to_fp16_for_smollm2_shapes():
    fp16 = bytes_per_token(SMOLLM2, "fp16", torch.float32)
    assert fp16 == 2 * 30 * 3 * 64 * 2
    assert bytes_per_token(SMOLLM2, None, torch.bfloat16) == fp16
    assert bytes_per_token(SMOLLM2, "fp32", torch.bfloat16) == 2 * fp16
    assert bytes_per_token(SMOLLM2, "q8_0", torch.float32) * 128 == 68 * fp16
    assert bytes_per_token(SMOLLM2, "q4_0", torch.float32) * 128 == 36 * fp16
    assert bytes_per_token(SMOLLM2, "nf4", torch.float32) * 128 == 36 * fp16
    assert bytes_per_token(SMOLLM2, "q4_1", torch.float32) * 128 == 40 * fp16  # 16 + 4 bytes per 32 values
    # KIVI per token per head (residual excluded), group 32: keys 64·b/8 + 2·2·64/32, values 64·b/8 + 2·2·2
    assert bytes_per_token(SMOLLM2, "kivi4", torch.float32) == 30 * 3 * (32 + 8 + 32 + 8) == 0.3125 * fp16
    assert bytes_per_token(SMOLLM2, "kivi2", torch.float32) == 30 * 3 * (16 + 8 + 16 + 8) == 0.1875 * fp16
    assert bytes_per_token(SMOLLM2, "kivi4", torch.float32) <= 0.32 * fp16
    assert bytes_per_token(SMOLLM2, "kivi2", torch.float32) <= 0.19 * fp16
    assert bytes_per_token(SMOLLM2, "kivi4:g64:r128", torch.float32) == 30 * 3 * (32 + 4 + 32 + 8)
    assert bytes_per_token(SMOLLM2, "kivi4:g512", torch.float32) == 30 * 3 * (32 + 0.5 + 32 + 8)  # not whole
    # the residual: the newest seq_len mod r tokens in the model's dtype, for each sequence
    assert residual_bytes(SMOLLM2, "kivi4:g32:r128", 2, 1000, torch.bfloat16) == 2 * 30 * 3 * 2 * 64 * 104 * 2
    assert residual_bytes(SMOLLM2, "q4_0", 2, 1000, torch.bfloat16) == 0
    assert estimate_cache_bytes(SMOLLM2, "kivi2", 1, 4096, torch.float16) == 4096 * bytes_per_token(
        SMOLLM2, "kivi2", torch.float16)


# --- parsing kind strings ---------------------------------------------------------------------------------------

def test_parse_kind_resolves_aliases_and_defaults():
    assert parse_kind(None) is None
    # what a plain kind carries
    none = dict(key_bits=None, value_bits=None, group_size=None, residual_len=None, sinks=0, outlier_percent=0.0,
                rotate_keys=False, rotate_values=False, nuq=False, value_block=32, eviction=None)
    assert asdict(parse_kind("q4")) == {"name": "q4_0", "family": "block", **none}
    assert asdict(parse_kind("q4_1")) == {"name": "q4_1", "family": "block", **none}
    # sinks, outliers, rotations, nuq, value block: off unless named; both sides at the name's bits
    off = dict(sinks=0, outlier_percent=0.0, rotate_keys=False, rotate_values=False, nuq=False, value_block=32,
               eviction=None)
    four, two = {**off, "key_bits": 4, "value_bits": 4}, {**off, "key_bits": 2, "value_bits": 2}
    kivi4, kivi2 = {"name": "kivi4", "family": "kivi"}, {"name": "kivi2", "family": "kivi"}
    assert asdict(parse_kind("kivi4")) == {**kivi4, "group_size": 32, "residual_len": 32, **four}
    assert asdict(parse_kind("kivi2:g64")) == {**kivi2, "group_size": 64, "residual_len": 64, **two}  # r = g
    assert asdict(parse_kind("kivi4:r128")) == {**kivi4, "group_size": 32, "residual_len": 128, **four}
    assert asdict(parse_kind("kivi4:r128:g64")) == {**kivi4, "group_size": 64, "residual_len": 128, **four}


@pytest.mark.parametrize("kind, message", [
    ("kivi4:g0", "group size must be a positive multiple of 2"),
    ("kivi2:g6", "group size must be a positive multiple of 4"),
    ("kivi4:r48", "residual length must be a positive multiple of the group size 32"),
    ("kivi4:g64:r32", "residual length must be a positive multiple of the group size 64"),
    ("kivi4:r0", "residual length"),
    ("q8_0:g32", "takes no options"),
    ("fp16:r32", "takes no options"),
    ("kivi4:", "bad option ''"),
    ("kivi4:g32:g64", "gives option 'g' twice"),
    ("kivi4:x3", "bad option 'x3'"),
    ("kivi4:g-32", "bad option 'g-32'"),
    ("kivi5", "unknown cache kind"),
])
def test_bad_kind_strings_are_rejected_clearly(kind, message, tiny_lm):
    for call in (lambda: parse_kind(kind), lambda: make_cache(kind, tiny_lm.model),
                 lambda: bytes_per_token(tiny_lm.model.config, kind, torch.float32),
                 lambda: estimate_cache_bytes(tiny_lm.model.config, kind, 1, 8, torch.float32)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            call()
    with pytest.raises(ValueError, match="residual length"):
        Kivi4Layer(KindOptions("kivi4", group_size=32, residual_len=40))


# --- the layer API ----------------------------------------------------------------------------------------------

def _kv(batch=3, seq=9, head_dim=40, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 2, seq, head_dim, generator=gen).to(dtype),
            torch.randn(batch, 2, seq, head_dim + 24, generator=gen).to(dtype))  # V may have another head_dim


def _layer(kind, keys, values, chunks=(None,), **options):
    """A layer of `kind` (with KIVI `options`) fed `keys`/`values` [B,H,T,D] in chunks split at the given sequence
    positions."""
    layer = LAYERS[kind](KindOptions(kind, **options))
    bounds = [0, *[c for c in chunks if c is not None], keys.shape[-2]]
    for start, end in zip(bounds, bounds[1:]):
        out = layer.update(keys[..., start:end, :], values[..., start:end, :])
    return layer, out


def _same(a: QuantLayer, b: QuantLayer) -> bool:
    return type(a) is type(b) and all(torch.equal(getattr(a, name), getattr(b, name)) for name in a.TENSORS)


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
            model(input_ids=ids[:, :8], cache=cache, use_cache=True)
            for i in range(8, end):
                model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
    caches[0].crop(-2)
    assert caches[0].get_seq_length() == 10 and cache_bytes(caches[0]) == cache_bytes(caches[1])
    assert all(_same(a, b) for a, b in zip(caches[0].layers, caches[1].layers))


@pytest.mark.parametrize("kind", [*QUANT, *KIVI])
def test_batch_reorder_select_and_repeat_permute_rows(kind):
    keys, values = _kv(seq=45)  # KIVI: 32 quantized tokens and 13 in the residual
    for apply, rows in [(lambda layer: layer.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
                        (lambda layer: layer.batch_select_indices(torch.tensor([0, 2])), [0, 2]),
                        (lambda layer: layer.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2])]:
        layer, _ = _layer(kind, keys, values)
        apply(layer)
        assert _same(layer, _layer(kind, keys[rows], values[rows])[0])


@pytest.mark.parametrize("kind", [*QUANT, *KIVI])
def test_reset_forgets_everything(kind):
    keys, values = _kv(seq=40)
    layer, _ = _layer(kind, keys, values)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0 and not layer.is_initialized
    layer.update(keys[..., :2, :], values[..., :2, :])
    assert _same(layer, _layer(kind, keys[..., :2, :], values[..., :2, :])[0])


# --- KIVI layers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KIVI)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kivi_holds_compressed_groups_and_a_full_precision_residual(kind, dtype):
    keys, values = _kv(batch=2, seq=70, head_dim=64, dtype=dtype)  # V head_dim 88: 3 blocks, the last padded
    layer, (k, v) = _layer(kind, keys, values, chunks=(50, 51, 60))  # prefill 50, one token, then 9 and 10
    bits = layer.bits
    assert layer.quantized_len() == 64 and layer.get_seq_length() == 70 and layer.get_mask_sizes(1) == (71, 0)
    assert layer.keys is None and layer.values is None
    assert layer.key_codes.dtype == layer.value_codes.dtype == torch.uint8
    assert layer.key_codes.shape == (2, 2, 64 * bits // 8, 64)  # per channel, tokens packed along the sequence
    assert layer.key_scales.shape == layer.key_mins.shape == (2, 2, 2, 64)  # 2 groups × 64 channels
    assert layer.value_codes.shape == (2, 2, 64, 3 * 32 * bits // 8)  # per token, 3 blocks of 32
    assert layer.value_scales.shape == layer.value_mins.shape == (2, 2, 64, 3)
    assert {getattr(layer, name).dtype for name in ("key_scales", "key_mins", "value_scales", "value_mins")} == {
        torch.float16}
    assert layer.residual_keys.dtype == layer.residual_values.dtype == dtype
    assert torch.equal(layer.residual_keys, keys[..., 64:, :])
    assert torch.equal(layer.residual_values, values[..., 64:, :])
    assert k.dtype == v.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
    assert torch.equal(k[..., 64:, :], keys[..., 64:, :]) and torch.equal(v[..., 64:, :], values[..., 64:, :])
    # keys per channel over groups of 32 tokens, values per token over blocks of 32 channels
    for got, want, limit in [(k, keys, _group_limit(keys[..., :64, :], bits, 32, dim=-2)),
                             (v, values, _group_limit(values[..., :64, :], bits, 32, dim=-1))]:
        error = (got[..., :64, :].float() - want[..., :64, :].float()).abs()
        output_rounding = (want[..., :64, :].float().abs() + limit) * 2**-8  # the output's own dtype (bf16)
        assert torch.all(error <= limit + output_rounding), kind


@pytest.mark.parametrize("kind", KIVI)
def test_kivi_state_depends_only_on_the_tokens_not_the_chunking(kind):
    keys, values = _kv(seq=100)
    one_go, out = _layer(kind, keys, values)
    for chunks in [(1, 2, 3, 31, 32, 33, 63, 64, 65, 99), (40, 90), (64, 96)]:
        chunked, chunked_out = _layer(kind, keys, values, chunks=chunks)
        assert _same(one_go, chunked) and all(torch.equal(a, b) for a, b in zip(out, chunked_out))


def test_kivi_residual_longer_than_a_group_quantizes_several_groups_at_once():
    keys, values = _kv(seq=100)
    layer, _ = _layer("kivi2", keys, values, chunks=tuple(range(1, 100)), group_size=16, residual_len=48)
    assert layer.quantized_len() == 96 and layer.key_scales.shape[-2] == 6 and layer.residual_keys.shape[-2] == 4
    assert _same(layer, _layer("kivi2", keys, values, group_size=16, residual_len=48)[0])


@pytest.mark.parametrize("kind", KIVI)
def test_kivi_crop_inside_the_residual_equals_a_layer_that_never_saw_the_tokens(kind):
    keys, values = _kv(seq=70)
    layer, _ = _layer(kind, keys, values, chunks=(66, 67, 68, 69))
    layer.crop(-4)
    shorter, _ = _layer(kind, keys[..., :66, :], values[..., :66, :])
    assert layer.get_seq_length() == 66 and layer.quantized_len() == 64 and _same(layer, shorter)
    layer.crop(0)
    assert _same(layer, shorter)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)


@pytest.mark.parametrize("kind", KIVI)
def test_kivi_crop_of_whole_groups_drops_them(kind):
    keys, values = _kv(seq=70)
    layer, _ = _layer(kind, keys, values)
    layer.crop(-38)  # the residual (6) and the second group (32)
    assert layer.get_seq_length() == 32 and layer.quantized_len() == 32 and layer.residual_keys.shape[-2] == 0
    assert _same(layer, _layer(kind, keys[..., :32, :], values[..., :32, :])[0])
    layer.crop(-100)  # more than there is: empty, still usable
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0 and layer.is_initialized
    layer.update(keys[..., :3, :], values[..., :3, :])
    assert _same(layer, _layer(kind, keys[..., :3, :], values[..., :3, :])[0])


@pytest.mark.parametrize("kind, options", [("kivi4", {}), ("kivi2", {}),
                                           ("kivi4", {"group_size": 8, "residual_len": 24})])
@pytest.mark.parametrize("crop", [-7, -20, -38, -45, -60])
def test_kivi_crop_across_the_residual_boundary_keeps_what_attention_sees(kind, options, crop):
    """Partly kept groups are dequantized into the residual: every kept token has exactly the K/V it had."""
    keys, values = _kv(seq=77)
    layer, (k, v) = _layer(kind, keys, values, chunks=(70, 71), **options)
    residual_len = layer.residual_len
    keep = 77 + crop
    layer.crop(crop)
    assert layer.get_seq_length() == keep and layer.quantized_len() == keep // residual_len * residual_len
    assert layer.nbytes() == _layer(kind, keys[..., :keep, :], values[..., :keep, :], **options)[0].nbytes()
    new_k, new_v = _kv(seq=1, seed=1)
    after_k, after_v = layer.update(new_k, new_v)  # attention after the crop: the kept K/V, then the new token
    assert torch.equal(after_k[..., :keep, :], k[..., :keep, :])
    assert torch.equal(after_v[..., :keep, :], v[..., :keep, :])
    assert torch.equal(after_k[..., keep:, :], new_k) or layer.residual_keys.shape[-2] == 0


def test_kivi_layers_are_built_from_kind_strings(tiny_lm):
    cache = make_cache("kivi2:g16:r64", tiny_lm.model)
    layer = cache.layers[0]
    assert isinstance(layer, Kivi2Layer) and (layer.group_size, layer.residual_len, layer.bits) == (16, 64, 2)
    layer = make_cache("kivi4", tiny_lm.model).layers[0]
    assert isinstance(layer, Kivi4Layer) and (layer.group_size, layer.residual_len, layer.bits) == (32, 32, 4)


# --- make_cache, aliases, greedy parity, quality ----------------------------------------------------------------

def test_make_cache_kinds_and_aliases(tiny_lm):
    model = tiny_lm.model
    assert isinstance(make_cache(None, model), DynamicCache) and isinstance(make_cache("fp32", model), DynamicCache)
    assert isinstance(make_cache("fp16", model).layers[0], CastLayer)
    assert isinstance(make_cache("q8", model).layers[0], Q8_0Layer)
    assert isinstance(make_cache("q4", model).layers[0], Q4_0Layer)
    assert isinstance(make_cache("nf4", model).layers[0], NF4Layer)
    assert isinstance(make_cache("q4_1", model).layers[0], Q4_1Layer)
    assert isinstance(make_cache("kivi4", model).layers[0], KiviLayer)
    assert len(make_cache("q8_0", model).layers) == model.config.num_hidden_layers
    assert bytes_per_token(model.config, "q8", model.dtype) == bytes_per_token(model.config, "q8_0", model.dtype)
    assert bytes_per_token(model.config, "q4", model.dtype) == bytes_per_token(model.config, "q4_0", model.dtype)
    with pytest.raises(ValueError, match="unknown cache kind"):
        make_cache("q2", model)


@pytest.mark.parametrize("kind", ["q8_0", "q4", "nf4", "q4_1", "kivi4", "kivi2"])
@pytest.mark.parametrize("prompts", [["hello world, this is"], ["The quick brown fox", "a"]])
def test_greedy_matches_transformers_with_the_same_quantized_cache(tiny_lm, kind, prompts):
    enc = tiny_lm.tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(prompts) == 1 or (enc.attention_mask == 0).any()  # the batch of 2 is really left-padded
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=16, temperature=0, cache_kind=kind))
    ours = gen.generate(enc.input_ids, enc.attention_mask)
    assert isinstance(gen.cache.layers[0], QuantLayer)
    assert gen.cache.get_seq_length() > 32  # KIVI: a group was quantized on the way
    hf = tiny_lm.model.generate(**enc, max_new_tokens=16, do_sample=False,
                                cache=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("kind", ["kivi4:g8:r16", "kivi2:g4:r8"])
def test_greedy_matches_transformers_with_kivi_options_and_many_flushes(tiny_lm, kind):
    # GenerateConfig.cache_kind takes bare names: the cache with options is handed to the Generator directly.
    enc = tiny_lm.tokenizer(["The quick brown fox", "a"], return_tensors="pt", padding=True)
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=20, temperature=0))
    gen.state = DecodeState(make_cache(kind, tiny_lm.model))
    ours = gen.generate(enc.input_ids, enc.attention_mask)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=20, do_sample=False,
                                cache=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


def test_quantized_cache_works_for_a_whole_block_head_dim_and_beam_search(hd64_lm):
    enc = hd64_lm.tokenizer(["The quick brown fox", "a"], return_tensors="pt", padding=True)
    for kind in ("q8_0", "kivi4"):
        ours = generate(hd64_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=24,
                        temperature=0, cache_kind=kind)
        hf = hd64_lm.model.generate(**enc, max_new_tokens=24, do_sample=False,
                                    cache=make_cache(kind, hd64_lm.model))
        assert torch.equal(ours, hf)
    for kind in ("nf4", "kivi2"):
        beams = hd64_lm.model.generate(**enc, max_new_tokens=20, do_sample=False, num_beams=3,
                                       cache=make_cache(kind, hd64_lm.model))
        assert beams.shape == (2, enc.input_ids.shape[1] + 20)


def test_kivi4_beats_q4_0_on_kl_on_real_text(hd64_lm):
    """Asymmetric groups + a full-precision residual keep the next-token distributions closer to the reference."""
    probe = build_probe(hd64_lm.tokenizer, load_text("pydoc"), prompt_len=64, decode_steps=16, windows=4,
                        ppl_len=192, device=torch.device("cpu"))  # byte-level tokenizer: the needle needs ≥ ~160
    reference = run_probe(hd64_lm.model, probe, None)
    metrics = {kind: compare(reference, run_probe(hd64_lm.model, probe, kind)) for kind in ("q4_0", "kivi4", "kivi2")}
    assert 0 < metrics["kivi4"]["mean_kl"] < metrics["q4_0"]["mean_kl"] / 2
    assert metrics["kivi4"]["needle_kl"] < metrics["q4_0"]["needle_kl"] / 2
    assert metrics["kivi4"]["mean_kl"] < metrics["kivi2"]["mean_kl"]  # fewer bits cost quality


def test_estimator_follows_transformers_sliding_windows_for_the_native_cache():
    """Mistral-style sliding window of 8: the native DynamicCache keeps 7 tokens per layer; our kinds keep all."""
    from runner.infer.loading.models import load_model

    lm = load_model(config={"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "sliding_window": 8}, device="cpu", seed=0)
    ids = torch.arange(3, 23)[None]  # 20 tokens
    for kind in (None, "fp32", "fp16", "q8_0", "kivi4"):
        cache = make_cache(kind, lm.model)
        with torch.inference_mode():
            lm.model(input_ids=ids, cache=cache, use_cache=True)
        assert cache_bytes(cache) == estimate_cache_bytes(lm.model.config, kind, 1, 20, lm.model.dtype), kind
    assert estimate_cache_bytes(lm.model.config, None, 1, 20, torch.float32) == 2 * 2 * 2 * 16 * 7 * 4
