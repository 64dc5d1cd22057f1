"""Pure tensor quantizers for the KV cache: float tensors in, codes + fp16 scales (and minimums) out, and back.

Block kinds (blocks of BLOCK = 32 values along the last axis, head_dim; a ragged last block is zero-padded and
the padding is stored):
    q8_0  int8 code = round(x / s), s = absmax / 127, one fp16 s per block.
    q4_0  4-bit symmetric, s = absmax / 7, code + 8 in 1..15, two codes per uint8 byte, one fp16 s per block.
    nf4   index of the nearest of the 16 NormalFloat levels of x / absmax, two per byte, one fp16 absmax per block.
    q4_1  4-bit asymmetric: s = (max − min) / 15 and the minimum m, both fp16, per block; code = round((x − m) / s)
          in 0..15, two per byte. Its "scales" tensor holds each block's s then m: [..., 2·NB].
Groups (`quantize_groups`, used by q4_1 and by the KIVI cache): asymmetric b ∈ {2, 3, 4} bits over groups of
`group` values along any axis, s = (max − min) / (2^b − 1) and m per group in fp16; 8/b codes per uint8 byte at
2 and 4 bits, 8 codes in 3 bytes (one little-endian 24-bit word) at 3 bits.
Packing (`pack`). Along the last axis (head_dim) 2- and 4-bit codes are packed in planes, as llama.cpp packs q4_0:
the codes are cut into chunks of C = 16 (`PLANE`; fewer for rows too short), and the 8/b chunks of a group of C
bytes share them, chunk i in bits [b·i, b·(i+1)). So C consecutive values are C consecutive bytes under one shift,
and a compiled kernel that reads values in chunks of C loads bytes contiguously (`unpack_planes_expr`); with the
interleaved order (neighbours in one byte) inductor gathered byte by byte (one layer's q4_0 attention at 4096
columns: 3.6 ms, 1.2 ms in planes). A block of 32 values (block kinds) is one group of 16 bytes. Along any
other axis (KIVI's keys, packed along the sequence) code n is slot n mod 8/b of byte n // (8/b), first code in the
lowest bits: there a whole row of head_dim values shares one byte row and one shift.
Owns only the arithmetic; knows nothing of caches, layers, models or transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.infer.config.kinds import BLOCK, CODES_PER_UNIT  # defined with the grammar that checks them

CODE_BITS = {"q8_0": 8, "q4_0": 4, "nf4": 4, "q4_1": 4}
QMAX = {"q8_0": 127, "q4_0": 7, "nf4": 1}  # symmetric kinds: scale = absmax / QMAX
SCALE_BYTES = {"q8_0": 2, "q4_0": 2, "nf4": 2, "q4_1": 4}  # per block: fp16 scale (q4_1: + fp16 minimum)
FP16_MAX = torch.finfo(torch.float16).max
# The 16 NormalFloat levels of QLoRA (bitsandbytes' NF4 table), ascending.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2  # bucketize against these = nearest level
_NF4_PAIRS = torch.stack([NF4_LEVELS.repeat(16), NF4_LEVELS.repeat_interleave(16)], dim=-1)  # byte → (lo, hi)
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _on(device: torch.device, name: str, table: torch.Tensor) -> torch.Tensor:
    """`table` copied to `device` once, not on every call."""
    if (name, device) not in _ON_DEVICE:
        _ON_DEVICE[name, device] = table.to(device)
    return _ON_DEVICE[name, device]


def head_bytes(kind: str, head_dim: int) -> int:
    """Bytes one quantized head vector of `head_dim` values takes: codes of whole blocks + scales per block."""
    n_blocks = -(-head_dim // BLOCK)
    return n_blocks * (BLOCK * CODE_BITS[kind] // 8 + SCALE_BYTES[kind])


# --- block kinds along head_dim ---------------------------------------------------------------------------------

def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float → codes [..., NB*32] int8 (q8_0) or [..., NB*16] uint8 (4-bit), scales [..., NB] fp16.

    q4_1's scales are [..., 2·NB]: (scale, minimum) of each block, interleaved.
    """
    if kind == "q4_1":
        codes, scales, mins = quantize_groups(x, 4, BLOCK, dim=-1)  # [..., NB*16], [..., NB], [..., NB]
        return codes, torch.stack([scales, mins], dim=-1).flatten(-2)
    blocks = F.pad(x.float(), (0, -x.shape[-1] % BLOCK)).unflatten(-1, (-1, BLOCK))  # [..., NB, 32]
    absmax = blocks.abs().amax(-1, keepdim=True)  # [..., NB, 1]
    scales = (absmax / QMAX[kind]).clamp(max=FP16_MAX).half()  # [..., NB, 1]
    scaled = blocks / torch.where(scales > 0, scales.float(), 1.0)  # zero block → all codes mean 0
    if kind == "q8_0":
        return scaled.round().clamp(-127, 127).to(torch.int8).flatten(-2), scales.squeeze(-1)
    if kind == "q4_0":
        codes = (scaled.round().clamp(-7, 7) + 8).to(torch.uint8)  # [..., NB, 32] in 1..15
    elif kind == "nf4":
        midpoints = _on(x.device, "midpoints", _NF4_MIDPOINTS)
        codes = torch.bucketize(scaled.contiguous(), midpoints).to(torch.uint8)  # [..., NB, 32] in 0..15
    else:
        raise ValueError(f"unknown quantized kind {kind!r}")
    return pack(codes.flatten(-2), 4, dim=-1), scales.squeeze(-1)  # even index in the low nibble


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: codes [..., C], scales [..., NB] → [..., head_dim] in `dtype` (padding cropped)."""
    if kind == "q4_1":
        pairs = scales.unflatten(-1, (-1, 2))  # [..., NB, 2]
        return dequantize_groups(codes, pairs[..., 0], pairs[..., 1], 4, BLOCK, head_dim, dtype, dim=-1)
    if kind == "q8_0":
        values = codes.float()  # [..., NB*32]
    elif kind == "q4_0":
        values = unpack(codes, 4, dim=-1).float() - 8  # [..., NB*32]
    else:  # one lookup per byte: a 256 × 2 table of (low, high) levels, 2× faster than a lookup per nibble
        pairs = F.embedding(codes.long(), _on(codes.device, "pairs", _NF4_PAIRS))  # [..., NB*16, 2]
        chunk = plane_bytes(codes.shape[-1] * 2, 4)
        values = pairs.unflatten(-2, (-1, chunk)).transpose(-1, -2).flatten(-3)  # planes → [..., NB*32] in order
    blocks = values.unflatten(-1, (-1, BLOCK)) * scales.float().unsqueeze(-1)  # [..., NB, 32]
    return blocks.flatten(-2)[..., :head_dim].to(dtype)


# --- bit packing and asymmetric groups along any axis -----------------------------------------------------------

PLANE = 16  # bytes of a plane group along the last axis (see the module docstring)


def plane_bytes(n_codes: int, bits: int) -> int:
    """C, the bytes of a plane group for a row of `n_codes` `bits`-bit codes: 16, or the largest power of two
    below it whose group (C·8/bits codes) tiles the row."""
    per_byte, c = 8 // bits, PLANE
    while n_codes % (c * per_byte):
        c //= 2
    return c


def pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """uint8 codes < 2^bits, N along `dim` (a multiple of CODES_PER_UNIT[bits]) → N·bits/8 bytes along `dim`;
    planes along the last axis, interleaved along others (module docstring)."""
    if bits == 3:
        return _pack3(codes, dim)
    per_byte = 8 // bits
    if dim in (-1, codes.dim() - 1):
        planes = codes.unflatten(-1, (-1, per_byte, plane_bytes(codes.shape[-1], bits)))  # [..., NG, per_byte, C]
        packed = planes[..., 0, :]
        for i in range(1, per_byte):
            packed = packed | (planes[..., i, :] << (bits * i))
        return packed.flatten(-2)
    codes = codes.movedim(dim, -1).unflatten(-1, (-1, per_byte))  # [..., N/per_byte, per_byte]
    packed = codes[..., 0]
    for i in range(1, per_byte):
        packed = packed | (codes[..., i] << (bits * i))
    return packed.movedim(-1, dim)


def unpack(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of `pack`: bytes along `dim` → uint8 codes, 8/bits times as many along `dim`."""
    shape = list(packed.shape)
    shape[dim] = shape[dim] * 8 // bits
    return unpack_into(packed.new_empty(shape), packed, bits, dim)


def unpack_into(out: torch.Tensor, packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """`unpack` written into `out` (any dtype: the codes are converted on the way), no float temporaries: one
    copy per code position of a byte, each a plane of chunks (last axis) or a whole row (other axes). Returns `out`.
    """
    if bits == 3:
        return _unpack3_into(out, packed, dim)
    per_byte, mask = 8 // bits, 2**bits - 1
    if dim in (-1, packed.dim() - 1):
        c = plane_bytes(out.shape[-1], bits)
        slots = out.unflatten(-1, (-1, per_byte, c)).movedim(-2, -1)  # [..., NG, C, per_byte], a view of out
        packed = packed.unflatten(-1, (-1, c))  # [..., NG, C]
    else:
        slots = out.movedim(dim, -1).unflatten(-1, (-1, per_byte))  # [..., P, per_byte], a view of out
        packed = packed.movedim(dim, -1)  # [..., P]
    slots[..., 0].copy_(packed & mask)
    for i in range(1, per_byte):
        slots[..., i].copy_(packed >> (bits * i) if bits * (i + 1) == 8 else (packed >> (bits * i)) & mask)
    return out


def _pack3(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """3-bit codes, 8 along `dim` → one 24-bit word c0 + c1·2^3 + … + c7·2^21 → its 3 bytes, low byte first."""
    codes = codes.movedim(dim, -1).unflatten(-1, (-1, 8)).to(torch.int32)  # [..., N/8, 8]
    word = codes[..., 0]
    for i in range(1, 8):
        word = word | (codes[..., i] << (3 * i))
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1).to(torch.uint8)  # [..., N/8, 3]
    return packed.flatten(-2).movedim(-1, dim)


def _unpack3_into(out: torch.Tensor, packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_pack3`, written into `out` (one copy per code position of a word)."""
    triples = packed.movedim(dim, -1).unflatten(-1, (-1, 3)).to(torch.int32)  # [..., P/3, 3]
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)  # [..., P/3]
    slots = out.movedim(dim, -1).unflatten(-1, (-1, 8))  # [..., P/3, 8], a view of out
    for i in range(8):
        slots[..., i].copy_((word >> (3 * i)) & 7)
    return out


def quantize_groups(x: torch.Tensor, bits: int, group: int, dim: int = -1):
    """Asymmetric `bits`-bit codes over groups of `group` consecutive values along `dim` (zero-padded to whole groups).

    x with N values along `dim` → codes (NG·group·bits/8 uint8 along `dim`), scales and mins (NG fp16 along `dim`),
    NG = ceil(N / group). E.g. keys [B,H,T,D], dim=-2, group 32 → codes [B,H,T·b/8,D], scales [B,H,T/32,D].
    """
    qmax = 2**bits - 1
    y = x.float().movedim(dim, -1)  # [..., N]
    groups = F.pad(y, (0, -y.shape[-1] % group)).unflatten(-1, (-1, group))  # [..., NG, group]
    mins = groups.amin(-1, keepdim=True).clamp(-FP16_MAX, FP16_MAX).half()  # [..., NG, 1]
    scales = ((groups.amax(-1, keepdim=True) - mins.float()) / qmax).clamp(max=FP16_MAX).half()
    steps = (groups - mins.float()) / torch.where(scales > 0, scales.float(), 1.0)  # equal values → all codes 0
    codes = steps.round().clamp(0, qmax).to(torch.uint8).flatten(-2)  # [..., NG*group]
    return (pack(codes.movedim(-1, dim), bits, dim=dim), scales.squeeze(-1).movedim(-1, dim),
            mins.squeeze(-1).movedim(-1, dim))


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group: int,
                      length: int, dtype: torch.dtype, dim: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize_groups`: `length` values along `dim` (padding cropped) in `dtype`, or written into
    `out` (its dtype wins) and `out` returned.

    Decoding calls this for the whole KIVI cache in every layer at every step, so it makes two passes over the
    float32 result and no full-size temporaries: the codes unpacked into it, then code·s + m in place (addcmul).
    code·s is exact in float32 (a code of ≤ 4 bits times fp16's 11-bit significand), so whether a kernel fuses the
    multiply-add or not, the only rounding is the add's: a value dequantizes to the same float on every path and
    whatever slice it comes with. Writes straight into `out` (a view of the tensor attention reads) when that is
    float32 and no padding is cropped.
    """
    shape = list(codes.shape)
    shape[dim] = scales.shape[dim] * group  # padded length
    direct = out is not None and out.dtype == torch.float32 and shape[dim] == length
    values = out if direct and out is not None else torch.empty(shape, dtype=torch.float32, device=codes.device)
    unpack_into(values, codes, bits, dim)
    dim = dim % values.dim()  # groups split in place, not moved to the end: broadcasts along contiguous rows
    grouped = values.unflatten(dim, (-1, group))  # [..., NG, group, ...], a view of values
    scales, mins = scales.unsqueeze(dim + 1).float().contiguous(), mins.unsqueeze(dim + 1).float().contiguous()
    torch.addcmul(mins, grouped, scales, out=grouped)
    values = values.narrow(dim, 0, length)
    if out is None:
        return values.to(dtype)
    return out if direct else out.copy_(values)


def unpack_expr(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """`unpack` as one expression of indices (no writes into views), so a compiled graph computes it inside the
    kernel that consumes the codes. uint8 codes (int32 at 3 bits). Along the last axis: `unpack_planes_expr`
    flattened; along another, code n is its byte (3 bits: its 3-byte word) shifted by its slot."""
    dim = dim % packed.dim()
    if bits != 3 and dim == packed.dim() - 1:
        return unpack_planes_expr(packed, bits).flatten(-3)
    units = packed
    if bits == 3:  # three bytes → one 24-bit word of 8 codes (see _pack3)
        triples = packed.unflatten(dim, (-1, 3)).to(torch.int32)  # [..., P/3, 3, ...]
        units = triples.select(dim + 1, 0) | (triples.select(dim + 1, 1) << 8) | (triples.select(dim + 1, 2) << 16)
    per_unit = CODES_PER_UNIT[bits]
    shape = [*units.shape[:dim + 1], per_unit, *units.shape[dim + 1:]]
    spread = units.unsqueeze(dim + 1).expand(shape).flatten(dim, dim + 1)  # [..., N, ...]: each unit per_unit times
    slots = torch.arange(spread.shape[dim], device=packed.device) % per_unit  # [N]
    shifts = (slots * bits).to(spread.dtype).view(-1, *[1] * (spread.dim() - dim - 1))
    return (spread >> shifts) & (2**bits - 1)


def unpack_planes_expr(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [..., P] packed along the last axis (2 or 4 bits) → codes [..., NG, 8/bits, C]: group, plane, chunk,
    so that code (g, i, j) is value g·8/bits·C + i·C + j. Constant shifts per plane, stacked (a pointwise
    expression in inductor), never a shift by a tensor of amounts (which inductor does not vectorize)."""
    per_byte, mask = 8 // bits, 2**bits - 1
    groups = packed.unflatten(-1, (-1, plane_bytes(packed.shape[-1] * per_byte, bits)))  # [..., NG, C]
    planes = [groups & mask] + [(groups >> (bits * i)) & mask for i in range(1, per_byte)]
    return torch.stack(planes, dim=-2)


def _per_chunk(scales: torch.Tensor, block: int, planes: torch.Tensor) -> torch.Tensor | None:
    """Scales [..., NB] of blocks of `block` values → [..., NG, 8/b, 1], the scale of each chunk of `planes`
    ([..., NG, 8/b, C]), or None when a chunk straddles blocks."""
    chunk = planes.shape[-1]
    if block % chunk:
        return None
    return scales.float().repeat_interleave(block // chunk, -1).unflatten(-1, planes.shape[-3:-1])[..., None]


def levels_expr(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """levels[codes] for a table of a few levels (nf4's 16, nuq's 2^b), as a binary tree of selects on the code
    compared as a float: the same floats as the lookup, for the compiled engine. Inductor compiles a table index to
    a scalar, bounds-checked gather, and vectorizes selects on float compares (one layer's nf4 attention at 4096
    columns, one thread: 10.8 ms as a gather, 2.9 ms as this tree, q4_0 1.5 ms); selects on integer compares were
    not vectorized (45 ms for 4 levels)."""
    code = codes.float()

    def pick(low: int, high: int) -> torch.Tensor:  # the level of a code in [low, high)
        if high - low == 1:
            return levels[low]
        middle = (low + high) // 2
        return torch.where(code < middle, pick(low, middle), pick(middle, high))

    return pick(0, levels.shape[0])


def dequantize_expr(codes: torch.Tensor, scales: torch.Tensor, kind: str, head_dim: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """`dequantize` as one elementwise expression, for the compiled engine: the same floats (the same products of
    the same code values and scales), computed inside the kernel that reads them; 4-bit codes by chunk of their
    planes (`unpack_planes_expr`), so the kernel reads bytes contiguously."""
    if kind == "q4_1":
        pairs = scales.unflatten(-1, (-1, 2))  # [..., NB, 2]
        return dequantize_groups_expr(codes, pairs[..., 0], pairs[..., 1], 4, BLOCK, head_dim, dtype, dim=-1)
    if kind == "q8_0":
        values = codes.float().unflatten(-1, (-1, BLOCK)) * scales.float().unsqueeze(-1)  # [..., NB, 32]
        return values.flatten(-2)[..., :head_dim].to(dtype)
    planes = unpack_planes_expr(codes, 4)  # [..., NG, 2, C]
    # NF4_LEVELS moved inside the graph, not through `_on`: a compiled step that fills that dict recompiles
    values = planes.float() - 8 if kind == "q4_0" else levels_expr(planes, NF4_LEVELS.to(codes.device))
    block_scales = _per_chunk(scales, BLOCK, planes)
    assert block_scales is not None, "4-bit planes' chunks lie within blocks of BLOCK values"
    return (values * block_scales).flatten(-3)[..., :head_dim].to(dtype)


def dequantize_groups_expr(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group: int,
                           length: int, dtype: torch.dtype, dim: int = -1) -> torch.Tensor:
    """`dequantize_groups` as one elementwise expression, for the compiled engine: inductor fuses the unpacking,
    code·s + m and the cast into the kernel attention's input comes from, per layer. The same floats as
    `dequantize_groups` (code·s is exact in float32, so only the add rounds, fused or not). Along the last axis
    by chunk of the codes' planes, where each chunk lies in one group."""
    dim = dim % codes.dim()
    if bits != 3 and dim == codes.dim() - 1:
        planes = unpack_planes_expr(codes, bits)  # [..., NG, 8/b, C]
        chunk_scales, chunk_mins = _per_chunk(scales, group, planes), _per_chunk(mins, group, planes)
        if chunk_scales is not None and chunk_mins is not None:  # both or neither: the same chunks
            out = torch.addcmul(chunk_mins, planes.float(), chunk_scales)
            return out.flatten(-3)[..., :length].to(dtype)
    values = unpack_expr(codes, bits, dim).float().unflatten(dim, (-1, group))  # [..., NG, group, ...]
    out = torch.addcmul(mins.unsqueeze(dim + 1).float(), values, scales.unsqueeze(dim + 1).float())
    return out.flatten(dim, dim + 1).narrow(dim, 0, length).to(dtype)
