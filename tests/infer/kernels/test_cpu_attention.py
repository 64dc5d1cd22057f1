"""The CPU attention kernel reads every static layout as attention over the layout's own dequantized K/V would."""

from __future__ import annotations

import pytest
import torch

from runner.infer.cache.layers import STORAGE_DTYPES
from runner.infer.cache.static.cache import static_length
from runner.infer.cache.static.kivi import StaticKiviLayer
from runner.infer.cache.static.plain import StaticPlainLayer, StaticQuantLayer
from runner.infer.config.kinds import parse_kind
from runner.infer.kernels import cpu_attention
from runner.infer.quant.formats import CODE_BITS

KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4:g8:r16", "kivi2:g8:r16", "kivi3:g8:r16",
         "kivi3:k4v3:g8:r16:s4:b64", "kivi2:g8:r16:s4:o2:b64:nuq", "kivi3:g8:r16:nuq", "kivi2:g8:r16:rot:rotv",
         "kivi4:g8:r16:o1:rot", "kivi4:g8:r16:b2048"]  # b2048: a value block wider than any stack row
HEADS, GROUPS, ROWS = 2, 3, 2


def _layer(kind: str, head_dim: int, length: int):
    options = parse_kind(kind)
    name = options.name
    shape = dict(batch=ROWS, heads=HEADS, key_dim=head_dim, value_dim=head_dim, dtype=torch.float32,
                 device=torch.device("cpu"))
    if name in STORAGE_DTYPES:
        return StaticPlainLayer(options, length=length, **shape)
    if name in CODE_BITS:
        return StaticQuantLayer(options, length=length, **shape)
    bits = 2 ** options.value_bits
    levels = (torch.linspace(0, 1, 2 ** options.key_bits).pow(1.3).half(),
              torch.linspace(0, 1, bits).pow(0.8).half())
    return StaticKiviLayer(options, length=static_length(kind, length), **shape, levels=levels)


def _reference(query: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(q·K)·V over [B,H,S,D] K/V as attention would read them, [B,S] bool mask → [B,1,Hq,Dv]."""
    rows = query.reshape(ROWS, HEADS, GROUPS, -1)  # [B,H,G,D]
    scores = (rows @ keys.transpose(-1, -2)) * keys.shape[-1] ** -0.5  # [B,H,G,S]
    probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
    return (probs @ values).reshape(ROWS, 1, HEADS * GROUPS, -1)


def _kernel_and_reference(layer, head_dim: int, key_channels: torch.Tensor, constant: dict | None = None,
                          flat_values: bool = False):
    """75 columns written one at a time into `layer` (K channels scaled by `key_channels` [D]; `constant`: channel
    → value, every column, and 20× it in each 8th column from the 3rd; `flat_values`: V's first 32 channels 0.5
    but channel 5, 10), row 1 left-padded by 5 columns; one query per row → (the kernel's output,
    softmax(q·K)·V over the K/V `write` hands attention), [B,1,Hq,D] each."""
    generator = torch.Generator().manual_seed(0)
    written = 75
    with torch.inference_mode():
        for column in range(written):
            keys = torch.randn(ROWS, HEADS, 1, head_dim, generator=generator) * key_channels
            for channel, value in (constant or {}).items():
                keys[..., channel] = value * (20 if column % 8 == 2 else 1)
            values = torch.randn(ROWS, HEADS, 1, head_dim, generator=generator)
            if flat_values:
                values[..., :32], values[..., 5] = 0.5, 10.0
            where = (torch.tensor([column]), torch.tensor(10**6))
            k, v = layer.write(keys, values, *where)  # [B,H,S,D] as attention reads them
        query = torch.randn(ROWS, HEADS * GROUPS, 1, head_dim, generator=generator)
        mask = torch.zeros(ROWS, k.shape[-2], dtype=torch.bool)
        mask[:, :written] = True
        mask[1, :5] = False
        return layer.attend(query, mask, head_dim**-0.5, *where), _reference(query, mask, k, v)


@pytest.mark.parametrize("head_dim", [64, 40, 36])  # 36: channels past the last 8 (scalar tails)
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_attends_as_torch_does_over_the_dequantized_cache(kind, head_dim):
    """75 columns written one at a time (KIVI: blocks quantized, the rest in its ring, sinks), row 1 left-padded
    by 5 columns; then one query per row: the kernel's output equals softmax(q·K)·V over the K/V `write` hands
    attention, to float32 rounding of a different summation order."""
    assert cpu_attention.load()
    channels = torch.ones(head_dim)
    channels[3] = 12.0  # one large key channel, as real keys have
    ours, reference = _kernel_and_reference(_layer(kind, head_dim, 96), head_dim, channels)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["kivi4:g8:r16:o2", "kivi2:g8:r16:o2:nuq"])
@pytest.mark.parametrize("side", ["key", "value"])
def test_an_outlier_in_a_group_whose_scale_is_zero_is_read_exactly(kind, side):
    """A key channel (a value block) constant but for one spike per group (per column): the spike is kept as an
    outlier, the group's scale is 0, so the kernel's level-domain sums (p·s)·l cannot hold it and must add
    q·(exact − m) (p·(exact − m)) instead."""
    assert cpu_attention.load()
    layer = _layer(kind, 64, 96)
    flat = dict(constant={5: 0.5}) if side == "key" else dict(flat_values=True)
    ours, reference = _kernel_and_reference(layer, 64, torch.ones(64), **flat)
    scales, outliers = getattr(layer, f"{side}_scales"), getattr(layer, f"{side}_outliers").float()
    assert ((scales[..., 5] if side == "key" else scales[..., :16, 0]) == 0).all() and (outliers == 10.0).any()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_a_static_step_reads_the_cache_through_the_kernel(tiny_lm):
    """The compiled engine's step (run uncompiled here) hands its cache to attention, which calls the kernel once
    per layer and step for keys and once for values."""
    from runner.infer.compiled.engine import CompiledEngine

    engine = CompiledEngine(tiny_lm.model, compile=False)
    state = engine.state("q4_0", 1, 32, 64)
    with torch.inference_mode():  # as the Generator runs it (the engine's caches are inference tensors)
        state.prefill(tiny_lm.model, torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long))
        with torch.profiler.profile() as profile:
            state.feed(tiny_lm.model, torch.tensor([5]), torch.tensor([True]))
    calls = {event.key: event.count for event in profile.key_averages()}
    layers = tiny_lm.model.config.num_hidden_layers
    assert calls.get("runner::cache_scores") == layers and calls.get("runner::cache_weighted") == layers


@pytest.mark.parametrize("kind, storage, read", [("fp32", torch.float32, True), ("bf16", torch.bfloat16, True),
                                                 ("fp16", torch.bfloat16, False), ("q4_0", torch.float32, True),
                                                 ("q4_0", torch.bfloat16, False), ("kivi2:g8:r16", torch.float32, True),
                                                 ("kivi2:g8:r16", torch.bfloat16, False)])
def test_the_kernel_reads_a_layer_only_where_it_rounds_as_attention_does(kind, storage, read):
    """The torch path hands attention K/V in the model's dtype; the kernel attends over decoded float32 values,
    so a bfloat16 model keeps the torch path for every layer whose values are not stored in bfloat16 (and no
    kernel call happens for it)."""
    from types import SimpleNamespace

    from runner.infer.cache.static.cache import StaticKVCache
    from runner.infer.compiled.attention import static_layer

    assert cpu_attention.load()
    layer = _layer(kind, 64, 96)
    query = torch.zeros(ROWS, HEADS * GROUPS, 1, 64, dtype=storage)
    found = static_layer(SimpleNamespace(layer_idx=0), StaticKVCache([layer], kind), query)
    assert (found is layer) == read


def test_the_kernel_reads_what_each_layer_holds_now():
    """The kernel's stores are kept by address between calls: two layers of one shape read in turn each give their
    own attention, and a column written again in place is read with its new values."""
    assert cpu_attention.load()
    generator = torch.Generator().manual_seed(1)
    layers = [_layer("kivi2:g8:r16:s4:o2", 64, 96), _layer("q4_0", 64, 96)]
    query = torch.randn(ROWS, HEADS * GROUPS, 1, 64, generator=generator)
    views = {}  # layer index → the K/V its last write handed attention
    with torch.inference_mode():
        for _ in range(2):  # the second round writes every column again, in place
            for i, layer in enumerate(layers):
                for column in range(40):
                    where = (torch.tensor([column]), torch.tensor(10**6))
                    k, v = layer.write(torch.randn(ROWS, HEADS, 1, 64, generator=generator),
                                       torch.randn(ROWS, HEADS, 1, 64, generator=generator), *where)
                views[i] = k, v
            for i, layer in enumerate(layers):
                k, v = views[i]
                mask = torch.zeros(ROWS, k.shape[-2], dtype=torch.bool)
                mask[:, :40] = True
                ours = layer.attend(query, mask, 64**-0.5, torch.tensor([39]), torch.tensor(10**6))
                torch.testing.assert_close(ours, _reference(query, mask, k, v), rtol=1e-5, atol=1e-5)


def test_a_kivi_write_without_views_hands_attention_nothing_and_attention_says_so():
    """views off (the eager block-completing step): the write returns 0 columns, the kernel's attention is the
    same as with views on, and the torch path, were it reached, refuses instead of attending over nothing."""
    from types import SimpleNamespace

    from runner.infer.compiled.attention import attend_reduced

    assert cpu_attention.load()
    layer = _layer("kivi3:k4v3:g8:r16:s4:b64", 64, 96)
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(ROWS, HEADS * GROUPS, 1, 64, generator=generator)
    with torch.inference_mode():
        for column in range(36):  # column 35 completes a block: s 4 + 2 blocks of r 16
            where = (torch.tensor([column]), torch.tensor(10**6))
            layer.views = column < 35
            k, v = layer.write(torch.randn(ROWS, HEADS, 1, 64, generator=generator),
                               torch.randn(ROWS, HEADS, 1, 64, generator=generator), *where)
        assert k.shape[-2] == 0 and v.shape[-2] == 0
        mask = torch.zeros(ROWS, layer.max_cache_len, dtype=torch.bool)
        mask[:, :36] = True
        without = layer.attend(query, mask, 64**-0.5, *where)
        layer.views = True
        k, v = layer._view(layer._quantized(torch.tensor(36), torch.tensor(10**6)), torch.float32)
        torch.testing.assert_close(without, _reference(query, mask, k, v), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="no K/V"):
            attend_reduced(SimpleNamespace(layer_idx=0), query, k[..., :0, :], v[..., :0, :], None)


@pytest.mark.parametrize("kind", ["q4_0", "kivi4:g12:r36:s5:o1:rot:rotv"])
def test_the_kernel_attends_over_many_tiles_on_many_threads(kind):
    """Over 300 columns (3 tiles of 128 per row and head, partial sums added across tiles and segments) on 4
    threads; g12: groups and outlier chunks that are not powers of 2 (the kernel divides)."""
    assert cpu_attention.load()
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        layer = _layer(kind, 64, 400)
        generator = torch.Generator().manual_seed(3)
        query = torch.randn(ROWS, HEADS * GROUPS, 1, 64, generator=generator)
        with torch.inference_mode():
            for start in range(0, 330, 30):
                columns = torch.arange(start, start + 30)
                where = (columns, torch.tensor(10**6))
                k, v = layer.write(torch.randn(ROWS, HEADS, 30, 64, generator=generator),
                                   torch.randn(ROWS, HEADS, 30, 64, generator=generator), *where)
            mask = torch.zeros(ROWS, k.shape[-2], dtype=torch.bool)
            mask[:, :330] = True
            mask[0, 100:140] = False  # a gap across a tile's edge
            ours = layer.attend(query, mask, 64**-0.5, *where)
        torch.testing.assert_close(ours, _reference(query, mask, k, v), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_engine_s_block_completing_step_decodes_no_region_and_gives_the_same_logits(tiny_lm, monkeypatch):
    """The one step in r that completes a KIVI block runs eagerly with views off (attention reads the kernel):
    the region is not decoded for attention's signature, and the logits are those of the same step with views
    on (to float rounding: each engine picks its Linear weights' layout by timing them)."""
    from runner.infer.cache.static.cache import StaticKVCache
    from runner.infer.compiled.engine import CompiledEngine

    model = tiny_lm.model
    decoded = []
    real_view = StaticKiviLayer._view
    monkeypatch.setattr(StaticKiviLayer, "_view", lambda self, *a: decoded.append(1) or real_view(self, *a))
    logits = []
    for views in (False, True):
        if views:
            monkeypatch.setattr(StaticKVCache, "kernel_attends", lambda self, dtype: False)
        state = CompiledEngine(model, compile=False).state("kivi4:g8:r16", 1, 64, 64)
        with torch.inference_mode():
            state.prefill(model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), torch.ones(1, 10, dtype=torch.long))
            for token in range(11, 16):  # columns 10..14
                state.feed(model, torch.tensor([token]), torch.tensor([True]))
            assert state.cache.needs_coding(state.length, 1)
            decoded.clear()
            logits.append(state.feed(model, torch.tensor([16]), torch.tensor([True])))  # column 15 ends a block
        assert bool(decoded) == views
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-6)  # (each engine times its weights' layout)


def test_the_ops_refuse_a_segment_whose_query_set_or_output_does_not_exist():
    """The kernel trusts a segment's query set and output as offsets: an index past those the call has is an
    error before any read."""
    assert cpu_attention.load()
    layer = _layer("fp16", 64, 96)
    keys, values = layer.sides()
    after = dict(start_plus_limit=True, stop=96, stop_plus_limit=False)  # a second segment: the columns past 10
    queries = torch.zeros(1, ROWS, HEADS, GROUPS, 64)  # one query set
    with pytest.raises(ValueError, match="query is not below 1"):
        cpu_attention.scores(queries, [cpu_attention.Segment(keys), cpu_attention.Segment(keys, query=1, **after)],
                             None, 96, torch.tensor(10), 1.0)
    probs = torch.zeros(ROWS, HEADS, GROUPS, 96)
    with pytest.raises(ValueError, match="output is not below 1"):
        cpu_attention.weighted(probs, [cpu_attention.Segment(values), cpu_attention.Segment(values, output=1, **after)],
                               torch.tensor(10))
