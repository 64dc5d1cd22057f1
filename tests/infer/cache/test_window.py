"""Chunked prefill (same logits as the whole prefill), the sliding-window cache (against a direct reference with
an explicit attention mask) and decode_plan's buckets."""

import warnings

import pytest
import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.cache.window import make_window_cache, plan_decode
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import decode_one_token, positions_for, prefill, trim_mask
from runner.infer.generation.generator import Generator, generate

PROMPTS = ["hello world, this is a somewhat longer prompt", "a", "The quick brown fox jumps"]


def _tokens(lm, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, lm.model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_chunk", [1, 5, 16])
def test_chunked_prefill_gives_the_whole_prefills_logits_and_cache(tiny_lm, q_chunk):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    positions = positions_for(None, enc.attention_mask)
    results = []
    for chunk in (None, q_chunk):
        cache = make_cache(None, tiny_lm.model)
        with torch.no_grad():
            logits, mask, _ = prefill(tiny_lm.model, enc.input_ids, None, enc.attention_mask, positions, cache, chunk)
        results.append((logits, mask, cache.layers[0].keys))
    (whole, whole_mask, whole_keys), (chunked, chunked_mask, chunked_keys) = results
    assert torch.allclose(chunked, whole, atol=1e-5, rtol=1e-4)
    assert torch.equal(chunked_mask, whole_mask) and torch.allclose(chunked_keys, whole_keys, atol=1e-5)


def test_chunked_prefill_decodes_the_same_tokens(tiny_lm):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    args = dict(attention_mask=enc.attention_mask, max_new_tokens=12, temperature=0)
    plain = generate(tiny_lm.model, enc.input_ids, **args)
    gen = Generator(tiny_lm.model, GenerateConfig(decode_plan="fixed", decode_q_chunk=4, decode_local_window=None,
                                                  max_new_tokens=12, temperature=0))
    assert torch.equal(gen.generate(enc.input_ids, enc.attention_mask), plain)
    assert gen.stats.plan.q_chunk == 4 and gen.stats.plan.local_window is None


def _window_reference_logits(model, ids: torch.Tensor, prompt_len: int, window: int, sinks: int) -> torch.Tensor:
    """One forward over the whole sequence with an explicit mask: prompt rows causal; decode row i sees j ≤ i with
    j < sinks or j ≥ i − window (what the cache holds before step i, plus the token itself)."""
    n = ids.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j <= i) & ((i < prompt_len) | (j < sinks) | (j >= i - window))
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[0]


@pytest.mark.parametrize("window, sinks", [(8, 0), (8, 4), (5, 2), (64, 4)])
def test_window_cache_attends_to_sinks_and_the_newest_tokens(tiny_lm, window, sinks):
    """Prefill 20 tokens whole, then teacher-force 24 through the window cache: each step's logits equal the
    reference's, and the cache never holds more than sinks + window tokens between steps."""
    model, prompt_len, steps = tiny_lm.model, 20, 24
    ids = _tokens(tiny_lm, prompt_len + steps)
    cache = make_window_cache(None, model, window, sinks)
    ones = torch.ones_like(ids)
    ours = []
    with torch.no_grad():
        logits, mask, _ = prefill(model, ids[:, :prompt_len], None, ones[:, :prompt_len],
                                  torch.arange(prompt_len)[None], cache)
        ours.append(logits[0])
        for pos in range(prompt_len, prompt_len + steps - 1):
            assert cache.get_seq_length() == mask.shape[1] <= max(sinks + window, prompt_len)
            mask = torch.cat([mask, ones[:, :1]], dim=1)
            ours.append(decode_one_token(model, ids[:, pos], mask, torch.tensor([pos]), cache)[0])
            mask = trim_mask(mask, cache)
    reference = _window_reference_logits(model, ids, prompt_len, window, sinks)[prompt_len - 1:-1]
    assert torch.allclose(torch.stack(ours), reference, atol=1e-4, rtol=1e-4)
    full = _window_reference_logits(model, ids, prompt_len, 10_000, 0)[prompt_len - 1:-1]
    assert window >= prompt_len + steps or not torch.allclose(reference, full, atol=1e-3)  # the window matters


def test_window_larger_than_the_sequence_changes_nothing(tiny_lm):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    args = dict(attention_mask=enc.attention_mask, max_new_tokens=10, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        windowed = generate(tiny_lm.model, enc.input_ids, decode_plan="fixed", decode_q_chunk=3,
                            decode_local_window=64, **args)
    assert torch.equal(windowed, generate(tiny_lm.model, enc.input_ids, **args))


@pytest.mark.parametrize("kind", ["fp16", "q8_0", "nf4"])
def test_window_bounds_the_bytes_of_every_supported_kind(tiny_lm, kind):
    ids = _tokens(tiny_lm, 40)
    sizes = {}
    for window in (None, 8):
        cfg = GenerateConfig(max_new_tokens=20, temperature=0, eos_token_id=[], cache_kind=kind,
                             decode_plan="fixed" if window else "none", decode_local_window=window,
                             decode_sink_tokens=2,
                             decode_q_chunk=None)
        gen = Generator(tiny_lm.model, cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gen.generate(ids)
        assert any("SLIDING WINDOW" in str(w.message) for w in caught) == bool(window)  # never silent
        sizes[window] = (cache_bytes(gen.cache), gen.cache.get_seq_length())
    assert sizes[8][1] == 10 and sizes[None][1] == 59
    assert sizes[8][0] * 59 == sizes[None][0] * 10  # bytes scale with the tokens held


def test_beam_search_over_a_chunked_prefill_is_unchanged(tiny_lm):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    args = dict(attention_mask=enc.attention_mask, max_new_tokens=8, num_beams=3)
    chunked = generate(tiny_lm.model, enc.input_ids, decode_plan="fixed", decode_q_chunk=4, decode_local_window=None,
                       **args)
    assert torch.equal(chunked, generate(tiny_lm.model, enc.input_ids, **args))


def test_decode_plan_buckets():
    cfg = dict(decode_bucket_short=100, decode_bucket_mid=1000, decode_q_chunk=32, decode_local_window=256,
               max_new_tokens=50)
    none = plan_decode(GenerateConfig(**cfg), 5000)
    assert (none.bucket, none.q_chunk, none.local_window) == ("none", None, None)
    auto = GenerateConfig(decode_plan="auto", **cfg)
    assert [(p.bucket, p.q_chunk, p.local_window) for p in (plan_decode(auto, n) for n in (50, 51, 950, 951))] == [
        ("short", None, None), ("mid", 32, None), ("mid", 32, None), ("long", 32, 256)]
    fixed = plan_decode(GenerateConfig(decode_plan="fixed", **cfg), 10)
    assert (fixed.bucket, fixed.q_chunk, fixed.local_window) == ("fixed", 32, 256)
    assert "SLIDING WINDOW of 256 tokens + 4 sink tokens" in fixed.describe()
    assert "full cache" in plan_decode(auto, 60).describe()


@pytest.mark.parametrize("settings, message", [
    (dict(decode_bucket_short=600, decode_bucket_mid=500), "decode_bucket_mid"),
    (dict(decode_plan="auto", cache_kind="kivi4"), "KIVI"),
])
def test_decode_plan_settings_that_do_not_combine_are_rejected(settings, message):
    with pytest.raises(ValueError, match=message):
        GenerateConfig(**settings)


def test_planned_nll_measures_the_window(tiny_lm):
    """Without a window it equals the quality module's teacher-forced NLL; a small window changes it."""
    from runner.infer.cache.window import DecodePlan
    from runner.infer.measure.quality import planned_nll, teacher_forced_logprobs

    ids = _tokens(tiny_lm, 48, seed=5)
    logprobs = teacher_forced_logprobs(tiny_lm.model, ids, 24, None, score_prefill=True)[0]  # [24, V]
    reference = float(-logprobs.gather(-1, ids[0, 24:, None]).mean())
    full = planned_nll(tiny_lm.model, ids, 24, DecodePlan("fixed", "fixed", 48, 5, None, 0))
    windowed = planned_nll(tiny_lm.model, ids, 24, DecodePlan("fixed", "fixed", 48, 5, 6, 2))
    assert abs(full - reference) < 1e-4 and abs(windowed - full) > 1e-3
