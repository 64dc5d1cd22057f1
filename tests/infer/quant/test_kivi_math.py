"""The KIVI options' arithmetic: 3-bit packing, the Hadamard rotation, outliers kept exact, fitted levels."""

import pytest
import torch

from runner.infer.quant import kivi_math as kvcodes
from runner.infer.quant.formats import dequantize_groups, pack, quantize_groups, unpack
from runner.infer.quant.kivi_math import (
    dequantize_levels,
    fit_levels,
    hadamard_rotation,
    index_dtype,
    normalized,
    outlier_count,
    quantize_levels,
    restore_outliers,
    rotate,
    split_outliers,
    unrotate,
)


def _x(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + 0.5


def test_three_bit_codes_pack_eight_into_three_bytes_along_any_axis():
    codes = torch.randint(0, 8, (2, 16, 8, 24), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    for dim in (-1, -2, 1):
        packed = pack(codes, 3, dim=dim)
        assert packed.dtype == torch.uint8 and packed.shape[dim] * 8 == codes.shape[dim] * 3
        assert torch.equal(unpack(packed, 3, dim=dim), codes)
    word = sum(int(codes[0, 0, 0, i]) << (3 * i) for i in range(8))  # first code in the lowest bits
    assert pack(codes, 3)[0, 0, 0, :3].tolist() == [word & 255, (word >> 8) & 255, word >> 16]


@pytest.mark.parametrize("dim, group", [(-1, 32), (-2, 32), (-2, 8), (-1, 16)])
def test_three_bit_groups_are_within_half_a_step(dim, group):
    x = _x(2, 3, 64, 40, seed=group)
    out = dequantize_groups(*quantize_groups(x, 3, group, dim=dim), 3, group, x.shape[dim], torch.float32, dim=dim)
    y = x.movedim(dim, -1)
    groups = torch.nn.functional.pad(y, (0, -y.shape[-1] % group)).unflatten(-1, (-1, group))
    spread = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)).expand_as(groups).flatten(-2)
    limit = spread[..., :y.shape[-1]].movedim(-1, dim) / 14 + x.abs() * 2**-10 + 1e-6  # half of range / 7
    assert torch.all((out - x).abs() <= limit)


@pytest.mark.parametrize("dim", [16, 64, 96, 128, 80])
def test_rotation_is_orthogonal_and_a_round_trip_without_quantization_is_exact(dim):
    rotation = hadamard_rotation(dim)
    assert torch.allclose(rotation @ rotation.T, torch.eye(dim), atol=1e-6)
    block = dim & -dim
    assert torch.all((rotation == 0) | (rotation.abs() == block**-0.5))  # ±1/√block: Hadamard blocks
    assert torch.equal((rotation != 0).sum(-1), torch.full((dim,), block))
    x = _x(2, 3, 10, dim)
    assert torch.allclose(unrotate(rotate(x)), x, atol=1e-5, rtol=1e-5)
    assert torch.equal(rotate(x, rotation), rotate(x)) and torch.equal(unrotate(x, rotation), unrotate(x))
    assert hadamard_rotation(dim) is rotation  # fixed: made once


def test_rotation_spreads_one_large_channel_over_all_of_them():
    x = torch.zeros(1, 64)
    x[0, 5] = 8.0
    assert torch.allclose(rotate(x).abs(), torch.full((1, 64), 1.0))  # 8 / √64 in every channel


@pytest.mark.parametrize("per_channel", [True, False])
def test_outliers_are_the_farthest_values_kept_exactly_and_replaced_inside_their_group(per_channel):
    x = _x(2, 2, 64, 64, seed=1) * 0.1
    x[0, 1, 3, 7], x[1, 0, 40, 60] = 50.0, -80.0  # two planted outliers, in different chunks
    count = outlier_count(1, 32, 64)
    filled, values, index = split_outliers(x, count, 32, 32, per_channel)
    assert count == 20 and values.shape == index.shape == (2, 2, 2, 20) and index.dtype == torch.int16
    assert values.dtype == torch.float16 and 3 * 64 + 7 in index[0, 1, 0].tolist()
    assert (40 - 32) * 64 + 60 in index[1, 0, 1].tolist()
    assert filled.abs().max() < 5  # the replacements are inside the rest of their group
    restored = restore_outliers(filled, values, index, 32)
    assert restored[0, 1, 3, 7] == 50 and restored[1, 0, 40, 60] == -80
    changed = restored != x
    assert torch.equal(restored[changed], x.half().float()[changed])  # only fp16 rounding of kept values


def test_outliers_come_back_into_a_cropped_padded_tensor():
    """Values dequantized from padded blocks (head_dim 40 in blocks of 32) are a narrowed view: the outliers still
    come back (an in-place scatter into its reshaped copy lost them, and the eager layer with it)."""
    x = _x(1, 2, 32, 40, seed=3) * 0.1
    x[0, 1, 5, 33] = 40.0
    filled, values, index = split_outliers(x, outlier_count(1, 32, 40), 32, 32, per_channel=False)
    padded = torch.nn.functional.pad(filled, (0, 24)).narrow(-1, 0, 40)
    assert restore_outliers(padded, values, index, 32)[0, 1, 5, 33] == 40


def test_outliers_remove_most_of_the_quantization_error_they_cause():
    x = _x(1, 2, 64, 64, seed=2) * 0.1
    x[0, 0, ::5, 9] = 30.0  # a spiky channel stretches its groups
    plain = dequantize_groups(*quantize_groups(x, 3, 32, dim=-2), 3, 32, 64, torch.float32, dim=-2)
    filled, values, index = split_outliers(x, outlier_count(1, 32, 64), 32, 32, per_channel=True)
    sparse = dequantize_groups(*quantize_groups(filled, 3, 32, dim=-2), 3, 32, 64, torch.float32, dim=-2)
    sparse = restore_outliers(sparse, values, index, 32)
    spiky = (sparse - x)[..., 9].pow(2).mean()
    assert spiky < (plain - x)[..., 9].pow(2).mean() / 10  # 26 spikes in 2 × 32 tokens: 20 kept per chunk
    assert (sparse - x).pow(2).mean() < (plain - x).pow(2).mean()


def test_outlier_counts_and_index_width():
    assert outlier_count(0, 32, 64) == 0 and outlier_count(1, 64, 64) == 41 and outlier_count(0.01, 8, 16) == 1
    assert index_dtype(128, 128) == torch.int16 and index_dtype(512, 64) == torch.int32


def test_lloyd_max_levels_beat_uniform_levels_on_a_peaked_distribution():
    gen = torch.Generator().manual_seed(4)
    u = (torch.randn(50_000, generator=gen) * 0.1 + 0.5).clamp(0, 1)  # mass in the middle, as normalized K/V
    levels = fit_levels(u, 3)
    assert levels.dtype == torch.float16 and levels.shape == (8,) and torch.all(levels[1:] > levels[:-1])
    assert 0 <= levels.min() and levels.max() <= 1

    def error(lv):
        lv = lv.float()
        return (lv[torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)] - u).pow(2).mean()
    assert error(levels) < error(torch.linspace(0, 1, 8)) / 2


@pytest.mark.parametrize("dim, group", [(-2, 32), (-1, 32)])
def test_non_uniform_codes_round_trip_to_the_nearest_level(dim, group):
    x = _x(2, 2, 64, 64, seed=5)
    levels = torch.tensor([0.0, 0.1, 0.3, 0.45, 0.55, 0.7, 0.9, 1.0]).half()
    codes, ranges, mins = quantize_levels(x, levels, 3, group, dim=dim)
    assert codes.dtype == torch.uint8 and codes.shape[dim] == 64 * 3 // 8
    out = dequantize_levels(codes, ranges, mins, levels, 3, group, 64, dim=dim)
    u = normalized(x, group, dim)
    nearest = levels.float()[(u.unsqueeze(-1) - levels.float()).abs().argmin(-1)]
    got = (out - mins_of(x, group, dim)) / span_of(x, group, dim)  # the level each value came back as
    assert (got - nearest).abs().le(1e-2).float().mean() > 0.99  # the nearest level (fp16 range: ties may move)
    half_gap = float((levels[1:] - levels[:-1]).max()) / 2  # never farther than half the widest gap
    assert torch.all((out - x).abs() <= half_gap * span_of(x, group, dim) * 1.01 + 1e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim, group, length", [(-2, 32, 64), (-1, 32, 40), (-1, 16, 64)])
def test_fused_non_uniform_decoding_gives_the_same_floats(bits, dim, group, length):
    """The expression form the compiled engine's graph uses equals the eager one bit for bit."""
    x = _x(2, 2, 64, 64, seed=bits).narrow(dim, 0, length)
    levels = (torch.linspace(0, 1, 2**bits) ** 2).half()
    quantized = quantize_levels(x, levels, bits, group, dim=dim)
    assert torch.equal(dequantize_levels(*quantized, levels, bits, group, length, dim=dim, fused=True),
                       dequantize_levels(*quantized, levels, bits, group, length, dim=dim))


def _groups(x, group, dim):
    return x.movedim(dim, -1).unflatten(-1, (-1, group))


def mins_of(x, group, dim):
    return _groups(x, group, dim).amin(-1).repeat_interleave(group, -1).movedim(-1, dim)


def span_of(x, group, dim):
    g = _groups(x, group, dim)
    return (g.amax(-1) - g.amin(-1)).repeat_interleave(group, -1).movedim(-1, dim)


@pytest.mark.parametrize("n, lanes", [(128, 64), (64, 128), (1, 8), (2, 8), (5, 3), (37, 13), (100, 9)])
def test_the_lane_median_kernel_gives_torch_medians(n, lanes):
    """runner's lane_median against torch.median over the same dim: equal values, ties (small integers), lanes
    past the last 8, n not a power of two, a lane holding a NaN."""
    if not kvcodes.load_outlier_ops():
        pytest.skip("runner's C++ kernels cannot be built here")
    for seed, x in enumerate((_x(2, 3, n, lanes), torch.randint(-3, 4, (2, 3, n, lanes)).float())):
        if seed == 0:
            x[1, 2, n // 2, lanes - 1] = float("nan")
        ours = torch.ops.runner.lane_median(x)
        torch.testing.assert_close(ours, x.median(-2, keepdim=True).values, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(ours).sum() == (seed == 0)


@pytest.mark.parametrize("n, k", [(8192, 164), (100, 1), (100, 100), (37, 5), (5000, 0)])
def test_the_top_indices_kernel_gives_topks_positions_in_order(n, k):
    """runner's top_indices against topk + sort on distinct scores (one row holding a NaN, which topk ranks
    largest); on tied ones (small integers) the same multiset of values, with the lowest positions among the ties
    at the cut."""
    if not kvcodes.load_outlier_ops():
        pytest.skip("runner's C++ kernels cannot be built here")
    scores = torch.rand(2, 3, n, generator=torch.Generator().manual_seed(n))
    scores[1, 2, n // 3] = float("nan")
    ours = torch.ops.runner.top_indices(scores, k)
    assert ours.dtype == torch.long and torch.equal(ours, scores.topk(k, dim=-1).indices.sort(-1).values)
    ties = torch.randint(0, 4, (2, 3, n), generator=torch.Generator().manual_seed(1)).float()
    ours = torch.ops.runner.top_indices(ties, k)
    assert torch.equal(ties.gather(-1, ours).sort(-1).values, ties.topk(k, dim=-1).values.sort(-1).values)
    assert bool((ours.diff(dim=-1) > 0).all())  # ascending, no repeats
    for row, taken in zip(ties.view(6, n), ours.view(6, k)):
        if k:
            cut = row[taken].min()  # the k-th largest
            tied = taken[row[taken] == cut]
            assert torch.equal(tied, (row == cut).nonzero().flatten()[:len(tied)])


@pytest.mark.parametrize("per_channel", [True, False])
def test_outliers_are_the_same_with_runners_kernels_and_without(per_channel, monkeypatch):
    if not kvcodes.load_outlier_ops():
        pytest.skip("runner's C++ kernels cannot be built here")
    x = _x(1, 3, 256, 40, seed=4)  # 40 channels in blocks of 16: a padded last block
    ours = split_outliers(x, 24, 128, 16, per_channel)
    monkeypatch.setattr(kvcodes, "_OUTLIER_OPS", [])
    theirs = split_outliers(x, 24, 128, 16, per_channel)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
