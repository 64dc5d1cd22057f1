"""Static caches: the KIVI layout over fixed shapes hands attention what kvcache.KiviLayer hands it, bit for bit,
whatever the write sizes, crops and beam reorders; it holds the bytes it claims; the fused dequantizer agrees."""

import pytest
import torch

from runner.infer.cache import codebooks
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import KINDS, estimate_cache_bytes
from runner.infer.cache.sizes import dims
from runner.infer.cache.static.cache import make_static_cache, static_length
from runner.infer.config.decoding import GenerateConfig, SpeculativeConfig
from runner.infer.config.kinds import parse_kind
from runner.infer.quant.formats import (
    dequantize,
    dequantize_expr,
    dequantize_groups,
    dequantize_groups_expr,
    levels_expr,
    quantize,
    quantize_groups,
)

B, H, D = 3, 2, 40  # head_dim 40: value blocks of 32 padded
# the options outliers, rotation and fitted levels (and all at once): static = eager to float tolerance (a rotation
# can be a matrix product over blocks of another length; bit for bit on CPU), bit for bit otherwise
OPTIONS = ["kivi4:g8:r16:o2", "kivi2:g4:r8:s3:o1:b8", "kivi3:k4v3:g8:r16:rot", "kivi2:g4:r8:rotv",
           "kivi4:g8:r24:s4:rot:rotv", "kivi3:g8:r16:nuq", "kivi3:k4v2:g8:r16:s4:b16:nuq",
           "kivi2:g32:r32:s4:o2:b64:nuq:rot", "kivi2:g8:r16:s4:o2:b64:nuq"]


def _levels(options) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Non-uniform levels standing in for fitted ones (nuq), else None."""
    if not options.nuq:
        return None
    return tuple((torch.linspace(0, 1, 2 ** bits) ** 1.5).half() for bits in (options.key_bits, options.value_bits))


def _pair(kind: str, columns: int, dtype=torch.float32):
    """(eager KiviLayer, StaticKiviLayer of `columns` columns) of the same kind and options."""
    options = parse_kind(kind)
    levels, entry = _levels(options), KINDS[options.name]
    eager = entry.eager(options, levels=levels)
    static = entry.static(options, batch=B, heads=H, length=static_length(kind, columns), key_dim=D, value_dim=D,
                          dtype=dtype, device=torch.device("cpu"), levels=levels)
    return eager, static


def _same(results, kind: str, context) -> None:
    """Eager K, V equal static K, V: bit for bit, or to float tolerance for a rotated kind."""
    if ":rot" in kind:
        for eager, static in ((results[0], results[2]), (results[1], results[3])):
            torch.testing.assert_close(static, eager, atol=2e-5, rtol=2e-5, msg=lambda m: f"{context}: {m}")
    else:
        assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3]), context


def _kv(n: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(B, H, n, D, generator=g) * 2 + 0.5).to(dtype),
            (torch.randn(B, H, n, D, generator=g) - 0.3).to(dtype))


def _write_both(eager, static, written: int, n: int, seed: int, padding: int = 0):
    """n new columns after `written` into both layers (the static one also `padding` columns of garbage after
    them, as a compiled prefill's last piece) → (eager K, V [B,H,written+n,D], static K, V cut to the same)."""
    keys, values = _kv(n + padding, seed, static.storage)
    eager_k, eager_v = eager.update(keys[..., :n, :], values[..., :n, :])
    static_k, static_v = static.write(keys, values, torch.arange(written, written + n + padding),
                                      torch.tensor(written + n))
    return eager_k, eager_v, static_k[..., :written + n, :], static_v[..., :written + n, :]


@pytest.mark.parametrize("kind", ["kivi4", "kivi2", "kivi4:g8:r24", "kivi2:g4:r8", "kivi3", "kivi3:g8:r24",
                                  "kivi3:k4v3:g32:r32", "kivi3:k2v4:g8:r16", "kivi2:g32:r32:b64", "kivi4:g8:r16:b16",
                                  "kivi3:k4v2:g8:r16:b8", "kivi4:g32:r32:s4", "kivi2:g4:r8:s1", "kivi4:g8:r24:s7",
                                  "kivi3:k4v3:g32:r32:s4:b64", "kivi3:k4v2:g8:r16:s40:b16", *OPTIONS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_kivi_hands_attention_the_eager_layers_kv_for_any_write_sizes(kind, dtype):
    """Single columns, pieces shorter and longer than r, a piece completing two blocks: equal after every write."""
    eager, static = _pair(kind, 400, dtype)
    written = 0
    for step, n in enumerate([5, 1, 1, 70, 1, 3, 24, 1, 2, 33, 1, 1, 1, 9]):
        results = _write_both(eager, static, written, n, seed=step)
        written += n
        assert all(t.dtype == dtype for t in results)
        _same(results, kind, (step, written))


@pytest.mark.parametrize("kind", ["kivi4", "kivi4:g8:r24", "kivi2:g4:r8", "kivi4:g8:r16:s4", "kivi2:g4:r8:s9:b8",
                                  "kivi2:g32:r32:s4:o2:b64:nuq:rot", "kivi3:g8:r16:o1:rotv"])
def test_static_kivi_ignores_the_padding_after_end(kind):
    """A compiled prefill pads its last piece on the right: the padding never enters the ring nor completes a
    block, so the next writes see the eager layer's K/V."""
    eager, static = _pair(kind, 400)
    written = 0
    for step, (n, padding) in enumerate([(5, 11), (1, 0), (40, 24), (7, 57), (1, 0), (1, 0), (30, 2), (1, 0)]):
        results = _write_both(eager, static, written, n, seed=step, padding=padding)
        written += n
        _same(results, kind, (step, written))


@pytest.mark.parametrize("kind", ["kivi4:g8:r24", "kivi2:g4:r8", "kivi3:g8:r16", "kivi3:k4v3:g8:r16", "kivi2:g4:r8:b64",
                                  "kivi4:g8:r24:s4", "kivi2:g4:r8:s3", "kivi3:k4v3:g8:r16:s4:b64", "kivi4:g8:r16:s50",
                                  "kivi2:g8:r16:s4:o2:b64:nuq", "kivi3:k4v3:g8:r16:s2:o1:rot:rotv"])
@pytest.mark.parametrize("crop", [1, 5, 24, 30])
def test_static_kivi_rollback_equals_the_eager_crop(kind, crop):
    """A crop inside the residual or across quantized blocks, then more writes: still equal (kept quantized
    columns go back to full precision dequantized, as in KiviLayer.crop)."""
    eager, static = _pair(kind, 200)
    written = 0
    for step, n in enumerate([17, 1, 1, 20, 1]):
        _write_both(eager, static, written, n, seed=step)
        written += n
    eager.crop(-crop)
    static.rollback(written - crop, written)
    written -= crop
    for step, n in enumerate([1, 6, 1, 25, 1], start=10):
        results = _write_both(eager, static, written, n, seed=step)
        written += n
        _same(results, kind, (step, written))


@pytest.mark.parametrize("kind", ["kivi4:g8:r16", "kivi2:g8:r16:s4:o2:b64:nuq"])
def test_static_kivi_rows_follow_their_beams(kind):
    eager, static = _pair(kind, 100)
    written = 0
    for step, n in enumerate([20, 1, 1]):
        _write_both(eager, static, written, n, seed=step)
        written += n
    parents = torch.tensor([2, 0, 0])
    eager.reorder_cache(parents)
    static.reorder_cache(parents)
    results = _write_both(eager, static, written, 11, seed=9)  # completes a block from reordered residuals
    _same(results, kind, "reordered")


@pytest.mark.parametrize("kind", ["kivi4", "kivi2:g16:r64", "kivi3:g8:r16", "kivi3:k4v3:g32:r32", "kivi2:g32:r32:b64",
                                  "kivi3:k4v2:b16", "kivi4:g32:r32:s4", "kivi3:k4v3:g32:r32:s4:b64", "kivi4:g8:r16:o2",
                                  "kivi3:g8:r16:rot:rotv", "kivi2:g128:r128:s4:o2:b64:nuq",
                                  "kivi3:k4v3:g128:r128:s4:b64",
                                  "kivi2:g32:r32:s4:o2:b64:nuq:rot"])
def test_static_kivi_holds_the_estimated_region_and_its_ring(tiny_lm, kind, tmp_path, monkeypatch):
    """Bytes = estimate_cache_bytes at all S columns (s sinks, then a multiple of r: no residual) + the ring of 2r
    columns in the model's dtype: sinks, codes, scales and minimums, outliers and their indices, codebooks (fitted
    to the model, as make_cache fits them), never the float K/V."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))  # nuq codes fitted into a fresh directory
    monkeypatch.setattr(codebooks, "_FITTED", {})
    model = tiny_lm.model
    cache = make_static_cache(kind, model, 2, 300)
    options = parse_kind(kind)
    ring = 2 * options.residual_len
    assert cache.length == static_length(kind, 300) and (cache.length - options.sinks) % ring == 0
    assert cache.length >= 300
    layers, heads, head_dim = dims(model.config)
    ring_bytes = 2 * layers * heads * 2 * head_dim * ring * model.dtype.itemsize  # rows × layers × heads × K,V
    assert cache_bytes(cache) == estimate_cache_bytes(model.config, kind, 2, cache.length, model.dtype) + ring_bytes


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim, group, length", [(-1, 32, 40), (-1, 8, 64), (-2, 8, 24), (-2, 32, 64)])
def test_fused_dequantizer_equals_dequantize_groups(bits, dim, group, length):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    quantized = quantize_groups(x.narrow(dim, 0, length), bits, group, dim=dim)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_groups_expr(*quantized, bits, group, length, dtype, dim=dim),
                           dequantize_groups(*quantized, bits, group, length, dtype, dim=dim))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "nf4", "q4_1"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_fused_block_dequantizer_equals_dequantize(kind, head_dim):
    x = torch.randn(2, 3, 17, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 3 - 1
    codes, scales = quantize(x, kind)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_expr(codes, scales, kind, head_dim, dtype),
                           dequantize(codes, scales, kind, head_dim, dtype))


@pytest.mark.parametrize("count", [2, 4, 8, 16])
def test_levels_expr_is_the_table_lookup(count):
    """The tree of selects picks exactly levels[code] for every code, in any shape (nf4's 16 levels, nuq's 2^b)."""
    levels = torch.randn(count, generator=torch.Generator().manual_seed(count)).sort().values
    codes = torch.randint(0, count, (3, 5, 7), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert torch.equal(levels_expr(codes, levels), levels[codes.long()])
    assert torch.equal(levels_expr(torch.arange(count), levels), levels)


@pytest.mark.parametrize("kind", ["kivi3:s4:o1", "kivi2:o1:rot", "kivi4:rotv:nuq", "kivi3:k4v2:b64:s4:rot",
                                  "kivi2:nuq", "kivi2:g128:r128:s4:o2:b64:nuq"])
def test_the_compiled_engine_serves_every_kivi_option(kind):
    """No KIVI option is refused any more: a run, a bench and the speculative config take them on the compiled
    engine."""
    assert GenerateConfig(engine="compiled", cache_kind=kind).cache_kind == kind
    assert SpeculativeConfig(engine="compiled", cache_kind=kind).cache_kind == kind
