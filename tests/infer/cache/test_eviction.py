"""KV eviction: each method against a small reference of which tokens it keeps, the layers storing exactly the kept
tokens of every kind, the decode chain's columns and positions staying right, the schedule, bytes, the Generator."""

import math

import pytest
import torch

from runner.infer.cache import eviction
from runner.infer.cache.evicting import EvictingMixin
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import estimate_cache_bytes, make_cache
from runner.infer.cache.static.cache import make_static_cache
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.eviction import EvictionOptions
from runner.infer.decode.forward import DecodeState
from runner.infer.generation.generator import Generator

KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4", "kivi4", "kivi2:g16:r32:s2",
         "kivi3:k4v2:g8:r16:s3:o1:b16"]
METHODS = ["streaming", "h2o", "snapkv:0.5:w8", "tova", "knorm", "expected"]


def _keys(b=1, h=2, t=12, d=8, seed=0):
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))


def _at(t, index):
    """t [B,H,T,D] at the columns index [B,H,k]."""
    return t.gather(2, index[..., None].expand(-1, -1, -1, t.shape[-1]))


def _sorted_topk(scores, k):
    return scores.topk(k, dim=-1).indices.sort(-1).values


# ---- each method against a reference of which tokens it keeps


def test_knorm_keeps_the_smallest_norm_keys_of_each_head():
    keys = _keys()
    keys[0, 0, 3] *= 0.01  # head 0: token 3 tiny, token 5 huge
    keys[0, 0, 5] *= 100
    kept = eviction.choose(eviction.score_knorm(keys), 6, None, 0, 0)
    norms = keys.norm(dim=-1)
    assert torch.equal(kept, _sorted_topk(-norms, 6))
    assert 3 in kept[0, 0] and 5 not in kept[0, 0]


def test_streaming_keeps_the_sinks_and_the_newest():
    kept = eviction.choose(eviction.score_streaming(_keys(t=12)), 6, None, sinks=2, window=0)
    assert kept[0, 0].tolist() == kept[0, 1].tolist() == [0, 1, 8, 9, 10, 11]


def test_pads_go_first_and_sinks_are_the_first_real_columns():
    valid = torch.tensor([[True] * 12, [False] * 5 + [True] * 7])
    kept = eviction.choose(eviction.score_streaming(_keys(b=2, t=12)), 5, valid, sinks=2, window=0)
    assert kept[0, 0].tolist() == [0, 1, 9, 10, 11] and kept[1, 1].tolist() == [5, 6, 9, 10, 11]
    kept = eviction.choose(eviction.score_streaming(_keys(b=2, t=12)), 9, valid, sinks=0, window=0)
    row = kept[1, 0].tolist()  # 7 real tokens and 2 pads (any two: they are masked), pads first
    assert row[2:] == list(range(5, 12)) and all(column < 5 for column in row[:2])


def test_tova_keeps_what_the_last_query_attends_to_most():
    d, t = 8, 10
    keys = torch.zeros(1, 2, t, d)
    q = torch.zeros(1, 4, 1, d)
    q[..., 0] = 10.0  # the last query looks along channel 0
    keys[0, :, [2, 6], 0] = 1.0  # tokens 2 and 6 point there, in both KV heads
    kept = eviction.choose(eviction.score_tova(q, keys, None), 3, None, 0, window=1)
    assert kept[0, 0].tolist() == kept[0, 1].tolist() == [2, 6, 9]  # the last token is protected
    reference = torch.softmax((q[0, :, 0] @ keys[0].repeat_interleave(2, 0).transpose(-1, -2)[0]) / math.sqrt(d), -1)
    assert torch.allclose(eviction.score_tova(q, keys, None)[0, 0], reference.mean(0))


def test_snapkv_keeps_what_the_window_attends_to_and_the_window():
    d, t, w = 8, 16, 4
    keys = torch.zeros(1, 1, t, d)
    q = torch.zeros(1, 2, w, d)
    q[..., 1] = 20.0
    keys[0, 0, 3, 1] = 1.0  # token 3 draws the window's attention; pooling spreads it to 1..5
    scores = eviction.score_snapkv(q, keys, None)
    kept = eviction.choose(scores, 9, None, 0, window=w)
    assert kept[0, 0].tolist() == [1, 2, 3, 4, 5, 12, 13, 14, 15]  # token 3's pooled neighbourhood, the window
    # reference: causal softmax of each window query, mean over the window, pooled by 5, mean over the group
    logits = (q[0] @ keys[0, 0].T) / math.sqrt(d)  # [2,w,t]
    for i in range(w):
        logits[:, i, t - w + i + 1:] = float("-inf")
    weights = logits.softmax(-1).mean(1)  # [2,t]
    pooled = torch.nn.functional.avg_pool1d(weights[None, :, : t - w], 5, 1, 2)[0]  # the keys before the window
    assert torch.allclose(scores[0, 0, : t - w], pooled.mean(0), atol=1e-6)


def test_snapkv_pools_only_the_keys_before_the_window():
    """kvpress pools the window's attention over the keys before the window, zero-padded: the window's own columns
    (which draw most of its attention here) must not raise the two keys just before it."""
    d, t, w = 8, 16, 4
    keys = torch.zeros(1, 1, t, d)
    q = torch.zeros(1, 1, w, d)
    q[..., 1] = 20.0
    keys[0, 0, t - w:, 1] = 1.0  # the window attends to itself
    keys[0, 0, 3, 1] = 0.5  # and a little to token 3
    scores = eviction.score_snapkv(q, keys, None)
    assert float(scores[0, 0, t - w - 2:t - w].max()) < float(scores[0, 0, 3]) / 5  # no borrowed window weight
    kept = eviction.choose(scores, 9, None, 0, window=w)
    assert kept[0, 0, :5].tolist() == [1, 2, 3, 4, 5]


def test_h2o_is_the_accumulated_attention_over_the_queries_that_see_each_key():
    q, keys = _keys(h=4, t=9, seed=1), _keys(h=2, t=9, seed=2)
    scores = eviction.score_h2o(q, keys, None)
    k = keys.repeat_interleave(2, 1)
    weights = ((q @ k.transpose(-1, -2)) / math.sqrt(8)).masked_fill(torch.ones(9, 9).triu(1).bool(),
                                                                      float("-inf")).softmax(-1)
    reference = weights.sum(-2) / torch.arange(9, 0, -1)
    assert torch.allclose(scores, reference.view(1, 2, 2, 9).mean(2), atol=1e-6)
    kept = eviction.choose(scores, 4, None, 0, 0)
    assert torch.equal(kept, _sorted_topk(scores, 4))


def test_expected_attention_keeps_keys_along_the_mean_query_scaled_by_value_norm():
    d, t = 8, 10
    keys, values = torch.zeros(1, 1, t, d), torch.ones(1, 1, t, d)
    keys[0, 0, [4, 7], 2] = 3.0
    values[0, 0, 7] *= 2  # token 7: the same key as 4, a larger value
    q = torch.zeros(1, 2, t, d)
    q[..., 2] = 5.0  # every query the same: covariance 0
    no_rotation = (torch.ones(16, d), torch.zeros(16, d))
    scores = eviction.score_expected(q, keys, values, None, *no_rotation, sinks=0)
    assert scores[0, 0].argmax() == 7 and scores[0, 0, 4] > scores[0, 0, 0]
    reference = torch.softmax(keys[0, 0] @ q[0, 0, 0] / math.sqrt(d), -1) * values[0, 0].norm(dim=-1)
    assert torch.allclose(scores[0, 0], reference, atol=1e-6)
    kept = eviction.choose(scores, 2, None, 0, 0)
    assert kept[0, 0].tolist() == [4, 7]


# ---- layers: what is stored is exactly the kept tokens


def _prefill(model, kind, ids, mask=None):
    cache = make_cache(kind, model)
    state = DecodeState(cache)
    with torch.no_grad():
        logits, _ = state.prefill(model, ids, torch.ones_like(ids) if mask is None else mask)
    return state, logits


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "q4_1", "kivi4:g8:r16", "kivi2:g8:r8:s2"])
def test_stored_tokens_are_the_kept_tokens_coded_as_if_fed_alone(kind, tiny_lm):
    """knorm's choice depends on the keys only: the evicting cache equals a cache of the kind fed, per head, the
    uncompressed prefill's float K/V at the smallest-norm columns (the codes of a block kind, KIVI's groups)."""
    model = tiny_lm.model
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    full, _ = _prefill(model, None, ids)
    state, _ = _prefill(model, f"{kind}+knorm:0.5", ids)
    reference = make_cache(kind, model)
    for i, layer in enumerate(state.cache.layers):
        keys, values = full.cache.layers[i].keys, full.cache.layers[i].values
        index = _sorted_topk(-keys.norm(dim=-1), 12)
        expect_keys, expect_values = reference.layers[i].update(_at(keys, index), _at(values, index))
        got_keys, got_values = layer.update(keys[..., :0, :], values[..., :0, :])  # the whole, dequantized
        assert torch.equal(got_keys, expect_keys) and torch.equal(got_values, expect_values), (kind, i)
    assert state.mask.shape == (1, 12) and state.cache.get_seq_length() == 12


def test_kept_index_records_the_columns_the_prompt_forward_kept(tiny_lm):
    """`kept_index` (what benchmarks compare with kvpress's kept sets): knorm's smallest-norm columns of each head of
    the prompt forward, [B,H,k] ascending; untouched by decode steps."""
    model = tiny_lm.model
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    full, _ = _prefill(model, None, ids)
    state, logits = _prefill(model, "fp32+knorm:0.5", ids)
    _greedy(state, model, logits, 2)
    for i, layer in enumerate(state.cache.layers):
        expect = _sorted_topk(-full.cache.layers[i].keys.norm(dim=-1), 12)
        assert torch.equal(layer.kept_index, expect), i


def _greedy(state, model, logits, steps):
    tokens = []
    with torch.no_grad():
        for _ in range(steps):
            token = logits.argmax(-1)
            tokens.append(token)
            logits = state.feed(model, token, torch.ones_like(token))
    return torch.stack(tokens, 1), logits


def test_a_window_covering_the_whole_prompt_decodes_as_the_uncompressed_cache(tiny_lm):
    model = tiny_lm.model
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    plain, plain_logits = _prefill(model, None, ids)
    evict, evict_logits = _prefill(model, "fp32+streaming:0.01", ids)  # keeps ceil(20 · 0.99) = 20
    assert isinstance(evict.cache.layers[0], EvictingMixin)
    assert torch.equal(_greedy(plain, model, plain_logits, 8)[0], _greedy(evict, model, evict_logits, 8)[0])


@pytest.mark.parametrize("padded", [False, True])
def test_decoding_after_eviction_equals_attention_over_the_kept_tokens_at_their_positions(padded, tiny_lm):
    """The reference: the uncompressed prefill's K/V gathered by hand (pads first, then the smallest norms),
    decoded with the positions of the real tokens: the decode chain's columns and positions must match."""
    model = tiny_lm.model
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0
    full, _ = _prefill(model, None, ids, mask)
    evict, logits = _prefill(model, "fp32+knorm:0.5", ids, mask)
    for layer in full.cache.layers:
        norms = -layer.keys.norm(dim=-1).masked_fill(~mask.bool()[:, None, :], float("inf"))
        index = _sorted_topk(norms, 8)
        layer.keys, layer.values = _at(layer.keys, index), _at(layer.values, index)
    kept_mask = torch.stack([mask[b].gather(0, index[b, 0]) for b in range(2)])
    assert torch.equal(evict.mask, kept_mask)
    full.mask = kept_mask
    ours, ours_logits = _greedy(evict, model, logits, 5)
    reference, reference_logits = _greedy(full, model, logits, 5)
    assert torch.equal(ours, reference) and torch.allclose(ours_logits, reference_logits, atol=1e-5)
    assert torch.equal(evict.seen, mask.sum(-1) + 5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_eviction_stacks_with_every_kind_decodes_and_crops(kind, method, tiny_lm, one_thread):
    model = tiny_lm.model
    spelled = f"{kind}+{method}" if ":" in method else f"{kind}+{method}:0.5"
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(3))
    state, logits = _prefill(model, spelled, ids)
    assert state.cache.get_seq_length() == 15 and state.mask.shape == (1, 15)
    tokens, logits = _greedy(state, model, logits, 6)
    assert torch.isfinite(logits).all() and tokens.shape == (1, 6)
    assert state.cache.get_seq_length() == 21 == state.mask.shape[1]
    assert cache_bytes(state.cache) == estimate_cache_bytes(model.config, spelled, 1, 36, model.dtype, prompt_len=30)
    state.cache.crop(-3)
    assert all(layer.get_seq_length() == 18 for layer in state.cache.layers)
    assert cache_bytes(state.cache) == estimate_cache_bytes(model.config, kind, 1, 18, model.dtype)


@pytest.mark.parametrize("kind", ["fp32", "q4_0", "kivi4:g8:r8"])
@pytest.mark.parametrize("method", ["knorm", "snapkv:0.5:w4", "h2o", "expected", "tova", "streaming"])
def test_the_schedule_compresses_back_to_the_prompts_size_every_n_steps(kind, method, tiny_lm, one_thread):
    model = tiny_lm.model
    spelled = (f"{kind}+{method}" if ":" in method else f"{kind}+{method}:0.5") + ":e4"
    ids = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(4))
    state, logits = _prefill(model, spelled, ids)
    lengths = []
    with torch.no_grad():
        for _ in range(9):
            token = logits.argmax(-1)
            logits = state.feed(model, token, torch.ones_like(token))
            lengths.append(state.cache.get_seq_length())
            assert state.mask.shape[1] == lengths[-1]
    assert lengths == [11, 12, 13, 10, 11, 12, 13, 10, 11]
    assert cache_bytes(state.cache) == estimate_cache_bytes(model.config, spelled, 2, 29, model.dtype, prompt_len=20)


def test_the_schedule_keeps_the_sinks_and_the_newest_under_streaming(tiny_lm):
    model = tiny_lm.model
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(5))
    state, logits = _prefill(model, "fp32+streaming:0.5:s2:e3", ids)
    full, full_logits = _prefill(model, None, ids)
    with torch.no_grad():
        for _ in range(3):
            token = logits.argmax(-1)
            logits = state.feed(model, token, torch.ones_like(token))
            full.feed(model, token, torch.ones_like(token))
    # prompt kept 0, 1, 8..11 (6); + 3 steps = 9 held → back to 6: the two sinks and the newest four columns
    held, every = state.cache.layers[0].keys, full.cache.layers[0].keys
    assert held.shape[-2] == 6
    assert torch.equal(held[..., :2, :], every[..., :2, :]) and torch.equal(held[..., 2:, :], every[..., -4:, :])


# ---- hooks, the engine's refusal, the Generator


def test_hooks_are_installed_once_and_leave_other_caches_alone(tiny_lm):
    model = tiny_lm.model
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(6))
    before, _ = _prefill(model, "q8_0", ids)
    make_cache("q8_0+knorm:0.5", model)
    make_cache("kivi4+snapkv:0.5", model)
    attention = model.model.layers[0].self_attn
    assert len(attention._forward_pre_hooks) == 1
    after, _ = _prefill(model, "q8_0", ids)
    assert torch.equal(before.cache.layers[0].key_codes, after.cache.layers[0].key_codes)
    assert after.cache.get_seq_length() == 10


def test_the_compiled_engine_refuses_what_it_cannot_evict_and_the_window_refuses_eviction(tiny_lm):
    """What the compiled engine does evict is tests/infer/compiled/test_eviction.py's."""
    make_static_cache("q8_0+snapkv:0.5", tiny_lm.model, 1, 32)
    with pytest.raises(ValueError, match="evicts tokens from a KIVI cache"):
        make_static_cache("kivi4+snapkv:0.5", tiny_lm.model, 1, 32)
    with pytest.raises(ValueError, match="on a decoding schedule"):
        make_static_cache("q8_0+snapkv:0.5:e4", tiny_lm.model, 1, 32)
    with pytest.raises(ValueError, match="evicts tokens from a KIVI cache"):
        GenerateConfig(cache_kind="kivi4+snapkv:0.5", engine="compiled")
    with pytest.raises(ValueError, match="does not stack with eviction"):
        GenerateConfig(cache_kind="q8_0+snapkv:0.5", decode_plan="auto")


def test_the_generator_decodes_with_eviction_end_to_end(tiny_lm):
    ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(7))
    generator = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=6, temperature=0, cache_kind="q8_0+snapkv:0.5"))
    out = generator.generate(ids)
    assert out.shape == (2, 36) and torch.equal(out[:, :30], ids)
    assert generator.state.cache.get_seq_length() == 15 + 5  # the last token is sampled, never fed


def test_kept_counts_follow_the_options():
    options = EvictionOptions("snapkv", 0.75)
    assert options.kept(30) == 8 and options.window == 64
