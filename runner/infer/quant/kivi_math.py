"""The arithmetic of the KIVI options (arXiv 2402.02750 plus KVQuant's and QuaRot's additions): pure functions of
tensors that the eager KIVI layer (kvcache.KiviLayer) and a static layout can both call.

    rotation   a fixed randomized Hadamard matrix R [D,D] (R·Rᵀ = I): x·R before quantizing, x̂·Rᵀ after, so one
               large channel is spread over all D and a group's range shrinks (QuaRot, llama.cpp). Sylvester
               Hadamard of the largest power of two dividing D, block-diagonal, with random ±1 signs (seed 0).
    outliers   dense-and-sparse (KVQuant): in every chunk of g tokens × D values the k values farthest from
               their quantization group's median (in median absolute deviations) are kept exact in fp16 with their
               index in the chunk (int16, int32 past 32767), and replaced by the mean of the rest of their group
               before quantizing, so they no longer stretch its range.
    nuq        non-uniform codes (KVQuant nuq): 2^b levels in [0, 1] fitted by Lloyd-Max (1-D k-means) to a
               layer's normalized values u = (x − min) / (max − min); a value is coded as its nearest level and
               comes back as min + (max − min)·level. The group keeps fp16 (max − min) and min.
Knows nothing of caches, layers or models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.infer.kernels import native
from runner.infer.quant.formats import FP16_MAX, levels_expr, pack, unpack, unpack_expr

ROTATION_SEED = 0
_ROTATIONS: dict[tuple[int, torch.device], torch.Tensor] = {}
_OUTLIER_OPS: list[bool] = []  # set by `load_outlier_ops`; read while tracing, so a plain global


# --- rotation ---------------------------------------------------------------------------------------------------

def hadamard_rotation(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed orthogonal [dim, dim] float32 matrix R of the `rot` / `rotv` options (made once per device)."""
    device = torch.device(device)
    if (dim, device) not in _ROTATIONS:
        block = dim & -dim  # the largest power of two dividing dim
        h = torch.ones(1, 1)
        while h.shape[0] < block:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2.0 - 1
        matrix = signs[:, None] * torch.block_diag(*[h] * (dim // block)) / block**0.5
        _ROTATIONS[dim, device] = matrix.to(device)
    return _ROTATIONS[dim, device]


def rotate(x: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """[..., D] → x·R in float32. `matrix`: R made beforehand (a layer holds it, so a compiled graph never looks
    it up in the module's table while tracing), else `hadamard_rotation`'s."""
    return x.float() @ (hadamard_rotation(x.shape[-1], x.device) if matrix is None else matrix)


def unrotate(x: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """x̂ → x̂·Rᵀ in float32 (a new tensor); `matrix` as in `rotate`."""
    return x.float() @ (hadamard_rotation(x.shape[-1], x.device) if matrix is None else matrix).T


# --- outliers kept exact ----------------------------------------------------------------------------------------

def outlier_count(percent: float, group: int, dim: int) -> int:
    """Values kept exact per chunk of `group` tokens × `dim` values: percent of them, rounded, at least one."""
    return max(1, round(percent * group * dim / 100)) if percent > 0 else 0


def index_dtype(group: int, dim: int) -> torch.dtype:
    return torch.int16 if group * dim <= 2**15 - 1 else torch.int32


def split_outliers(x: torch.Tensor, count: int, group: int, block: int, per_channel: bool):
    """x [B,H,n,D] float32 (n a multiple of `group`) → (x with its outliers replaced, values [B,H,n/g,k] fp16,
    indices [B,H,n/g,k] into each chunk's g·D values flattened token-major).

    A value's quantization group is its channel over the chunk's g tokens (`per_channel`, KIVI's keys) or its
    block of `block` channels of one token (values); its score is |x − group median| / (median absolute deviation
    + tiny): robust, so a group with several spikes still ranks every one of them high.
    """
    chunks = x.unflatten(-2, (-1, group))  # [B,H,NG,g,D]
    center, spread = _robust_stats(chunks, block, per_channel)
    score = ((chunks - center).abs() / (spread + 1e-6)).flatten(-2)  # [B,H,NG,g·D]
    index = top_indices(score, count)  # [B,H,NG,k]
    flat = chunks.flatten(-2)
    values = flat.gather(-1, index).clamp(-FP16_MAX, FP16_MAX).half()
    outlier = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, True).view_as(chunks)
    kept = torch.where(outlier, torch.nan, chunks)
    if per_channel:
        fill = kept.nanmean(-2, keepdim=True).expand_as(chunks)
    else:
        padded = F.pad(kept, (0, -x.shape[-1] % block), value=torch.nan).unflatten(-1, (-1, block))
        fill = padded.nanmean(-1, keepdim=True).expand_as(padded).flatten(-2)[..., :x.shape[-1]]
    filled = torch.where(outlier, fill.nan_to_num(0.0), chunks).flatten(-3, -2)  # [B,H,n,D]
    return filled, values, index.to(index_dtype(group, x.shape[-1]))


def _robust_stats(chunks: torch.Tensor, block: int, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(median, median absolute deviation) of each value's quantization group, broadcastable to chunks [..,g,D]."""
    if per_channel:  # a channel's g tokens: the D channels are the lanes
        center = lane_median(chunks)
        return center, lane_median((chunks - center).abs())
    dim = chunks.shape[-1]
    blocks = F.pad(chunks, (0, -dim % block)).unflatten(-1, (-1, block)).movedim(-3, -1)  # [..., NB, block, g]
    center = lane_median(blocks)  # a token's block of channels: the g tokens are the lanes
    spread = lane_median((blocks - center).abs())
    center, spread = (t.movedim(-1, -3).expand(*chunks.shape[:-1], -1, block).flatten(-2)[..., :dim]
                      for t in (center, spread))
    return center, spread


def load_outlier_ops() -> bool:
    """Load runner's kernels (native.load) for `lane_median` and `top_indices`; False when they cannot be. Called
    where a KIVI layer with outliers is made (outside compiled code), so that those two read a global while
    tracing."""
    if not _OUTLIER_OPS and native.load():
        torch.library.register_fake("runner::lane_median")(lambda x: x.new_empty(*x.shape[:-2], 1, x.shape[-1]))
        torch.library.register_fake("runner::top_indices")(
            lambda scores, k: scores.new_empty(*scores.shape[:-1], k, dtype=torch.long))
        _OUTLIER_OPS.append(True)
    return bool(_OUTLIER_OPS)


def _native(x: torch.Tensor) -> bool:
    return bool(_OUTLIER_OPS) and x.device.type == "cpu" and x.dtype == torch.float32


def lane_median(x: torch.Tensor) -> torch.Tensor:
    """x [..., n, L] → [..., 1, L], torch.median's value over n (the lower of the two middle ones) for each of
    the L lanes. On CPU runner's op where loaded (outlier_ops.cpp: aten's selection mispredicts a branch per value,
    10× slower here), else torch.median."""
    return torch.ops.runner.lane_median(x) if _native(x) else x.median(-2, keepdim=True).values


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., n] → int64 [..., k]: the positions of the k largest in ascending order. On CPU runner's op
    where loaded (outlier_ops.cpp; 7× faster than topk here), else topk and a sort: the same positions but where
    scores tie at the cut (the op takes the lowest positions)."""
    if _native(scores):
        return torch.ops.runner.top_indices(scores, k)
    return scores.topk(k, dim=-1, sorted=False).indices.sort(-1).values


def restore_outliers(x: torch.Tensor, values: torch.Tensor, index: torch.Tensor, group: int) -> torch.Tensor:
    """Dequantized x [B,H,n,D] with its kept outliers written back: a new tensor (x itself when k = 0). Out of
    place, so it holds for any x (a cropped, padded one too: scattering into a reshaped copy would be lost) and
    is one expression of a compiled graph."""
    if not values.shape[-1]:
        return x
    chunks = x.unflatten(-2, (-1, group)).flatten(-2)  # [B,H,NG,g·D]
    return chunks.scatter(-1, index.long(), values.to(x.dtype)).unflatten(-1, (group, -1)).flatten(-3, -2)


# --- non-uniform codes ------------------------------------------------------------------------------------------

def fit_levels(samples: torch.Tensor, bits: int, iterations: int = 30) -> torch.Tensor:
    """Lloyd-Max: 2^bits ascending levels in [0, 1] minimizing the squared error of nearest-level coding of
    `samples` (normalized values in [0, 1]), started from the uniform levels; fp16 (as stored)."""
    samples = samples.flatten().float()
    levels = torch.linspace(0, 1, 2**bits)
    for _ in range(iterations):
        nearest = torch.bucketize(samples, (levels[1:] + levels[:-1]) / 2)
        sums = torch.zeros_like(levels).index_add_(0, nearest, samples)
        counts = torch.bincount(nearest, minlength=len(levels)).float()
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels).sort().values
    return levels.half()


def normalized(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """x → (x − group min) / (group max − min) ∈ [0, 1] over groups of `group` along `dim` (x's shape; a
    constant group → 0). What `fit_levels` is fitted to."""
    y = x.float().movedim(dim, -1)
    groups = F.pad(y, (0, -y.shape[-1] % group)).unflatten(-1, (-1, group))
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    u = (groups - low) / torch.where(high > low, high - low, 1.0)
    return u.flatten(-2)[..., :y.shape[-1]].movedim(-1, dim)


def quantize_levels(x: torch.Tensor, levels: torch.Tensor, bits: int, group: int, dim: int = -1):
    """As quant.quantize_groups, with codes = the nearest of `levels` to u: → codes, ranges (max − min), mins."""
    y = x.float().movedim(dim, -1)
    groups = F.pad(y, (0, -y.shape[-1] % group)).unflatten(-1, (-1, group))  # [..., NG, group]
    mins = groups.amin(-1, keepdim=True).clamp(-FP16_MAX, FP16_MAX).half()
    ranges = (groups.amax(-1, keepdim=True) - mins.float()).clamp(max=FP16_MAX).half()
    u = (groups - mins.float()) / torch.where(ranges > 0, ranges.float(), 1.0)
    levels = levels.float().to(x.device)
    codes = torch.bucketize(u.contiguous(), (levels[1:] + levels[:-1]) / 2).to(torch.uint8).flatten(-2)
    return (pack(codes.movedim(-1, dim), bits, dim=dim), ranges.squeeze(-1).movedim(-1, dim),
            mins.squeeze(-1).movedim(-1, dim))


def dequantize_levels(codes: torch.Tensor, ranges: torch.Tensor, mins: torch.Tensor, levels: torch.Tensor,
                      bits: int, group: int, length: int, dim: int = -1, fused: bool = False) -> torch.Tensor:
    """Inverse of `quantize_levels`: float32 with `length` values along `dim`: min + range·level. `fused`: the
    codes unpacked as one expression (quant.unpack_expr) and the levels picked by quant.levels_expr, so a compiled
    graph computes it all where it is read (eagerly 20–30 % slower than quant.unpack's copies and a lookup); the
    same floats either way (level·range is exact in float32, two fp16 significands, so only the add rounds).
    `levels` on the codes' device already saves a copy (a layer keeps them there)."""
    codes = (unpack_expr if fused else unpack)(codes, bits, dim=dim)
    table = levels.float().to(codes.device)
    values = levels_expr(codes, table) if fused else table[codes.long()]  # padded length along dim
    dim = dim % values.dim()
    grouped = values.unflatten(dim, (-1, group))
    out = torch.addcmul(mins.unsqueeze(dim + 1).float(), grouped, ranges.unsqueeze(dim + 1).float())
    return out.flatten(dim, dim + 1).narrow(dim, 0, length)
