"""Our decode loop against transformers' generate(), and the Generator's stateful API."""


import pytest
import torch

from runner.errors import InferenceError
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import positions_for
from runner.infer.generation.generator import Generator, generate

PROMPTS = ["hello world, this is", "a", "The quick brown fox"]


def _batch(lm, prompts=PROMPTS):
    return lm.tokenizer(prompts, return_tensors="pt", padding=True)


def test_positions_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert positions_for(None, mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert positions_for(mask, torch.ones(2, 1, dtype=torch.long)).tolist() == [[2], [4]]


def test_greedy_matches_transformers_batch_of_one(tiny_lm):
    enc = _batch(tiny_lm, PROMPTS[:1])
    ours = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=24, temperature=0)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, hf)


def test_greedy_matches_transformers_padded_batch(tiny_lm):
    enc = _batch(tiny_lm)
    assert (enc.attention_mask == 0).any()  # really padded
    ours = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=24, temperature=0)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("kind", ["fp32", "fp16", "bf16"])
def test_greedy_matches_transformers_with_the_same_cache_kind(tiny_lm, kind):
    enc = _batch(tiny_lm)
    ours = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=16,
                    temperature=0, cache_kind=kind)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=16, do_sample=False,
                                cache=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


def test_half_precision_cache_holds_half_the_bytes(tiny_lm):
    enc = _batch(tiny_lm)
    sizes = {}
    for kind in ["fp32", "fp16"]:
        gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=4, temperature=0, cache_kind=kind))
        gen.generate(enc.input_ids, enc.attention_mask)
        sizes[kind] = cache_bytes(gen.cache)
    cfg = tiny_lm.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tokens = enc.input_ids.shape[1] + 3  # the last sampled token is not in the cache yet
    expected = 2 * cfg.num_hidden_layers * len(PROMPTS) * cfg.num_key_value_heads * tokens * head_dim * 4
    assert sizes == {"fp32": expected, "fp16": expected // 2}


def test_generate_iter_yields_what_generate_returns(tiny_lm):
    enc = _batch(tiny_lm, PROMPTS[:1])
    cfg = GenerateConfig(max_new_tokens=12, temperature=0)
    full = Generator(tiny_lm.model, cfg).generate(enc.input_ids)
    streamed = list(Generator(tiny_lm.model, cfg).generate_iter(enc.input_ids))
    assert all(isinstance(t, int) for t in streamed)
    assert streamed == full[0, enc.input_ids.shape[1]:].tolist()


def test_second_generate_continues_in_the_same_cache(tiny_lm):
    cfg = GenerateConfig(max_new_tokens=8, temperature=0, eos_token_id=[])
    a, b = tiny_lm.tokenizer("first turn", return_tensors="pt").input_ids, tiny_lm.tokenizer(
        " and then", return_tensors="pt").input_ids
    gen = Generator(tiny_lm.model, cfg)
    out1 = gen.generate(a)
    length_after_first = gen.cache.get_seq_length()
    out2 = gen.generate(b)
    assert gen.cache.get_seq_length() == length_after_first + 1 + b.shape[1] + 7  # pending + new + 7 decoded
    fresh = Generator(tiny_lm.model, cfg).generate(torch.cat([out1, b], dim=1))
    assert torch.equal(out2[0, b.shape[1]:], fresh[0, out1.shape[1] + b.shape[1]:])
    gen.reset()
    assert gen.cache is None and torch.equal(gen.generate(a), out1)


def test_eos_stops_a_row_and_pads_it(tiny_lm):
    enc = _batch(tiny_lm)
    free = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=10,
                    temperature=0, eos_token_id=[])
    eos = int(free[0, enc.input_ids.shape[1] + 2])  # make row 0's third token the EOS
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=10, temperature=0, eos_token_id=eos))
    out = gen.generate(enc.input_ids, enc.attention_mask)
    start = enc.input_ids.shape[1]
    assert gen.stats.stop_reasons[0] == "eos" and gen.stats.new_tokens[0] == 3
    assert out[0, start + 3:].eq(gen.pad_id).all()
    for row in range(1, len(PROMPTS)):  # other rows are unaffected up to their own stop
        n = gen.stats.new_tokens[row]
        assert torch.equal(out[row, start:start + n], free[row, start:start + n])


def test_stop_string_ends_generation(tiny_lm):
    enc = _batch(tiny_lm, PROMPTS[:1])
    free = generate(tiny_lm.model, enc.input_ids, max_new_tokens=12, temperature=0, eos_token_id=[])
    new = free[0, enc.input_ids.shape[1]:]
    stop = tiny_lm.tokenizer.decode(new[:6])[-2:]
    expected = next(n for n in range(1, 13) if stop in tiny_lm.tokenizer.decode(new[:n]))
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=12, temperature=0, eos_token_id=[],
                                                  stop_strings=[stop]), tokenizer=tiny_lm.tokenizer)
    gen.generate(enc.input_ids)
    assert gen.stats.stop_reasons == ["stop_string"] and gen.stats.new_tokens == [expected]


def test_max_seq_len_caps_the_sequence(tiny_lm):
    ids = tiny_lm.tokenizer("abcdef", return_tensors="pt").input_ids  # 6 tokens
    gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=50, temperature=0, eos_token_id=[], max_seq_len=10))
    out = gen.generate(ids)
    assert out.shape[1] == 10 and gen.stats.stop_reasons == ["max_seq_len"]
    with pytest.raises(InferenceError, match="max_seq_len"):
        Generator(tiny_lm.model, GenerateConfig(max_seq_len=6)).generate(ids)


def test_sampling_is_reproducible_with_the_same_seed_and_varies_across_seeds(tiny_lm):
    enc = _batch(tiny_lm)
    runs = [generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=16,
                     temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sampled_first_token_follows_the_model_distribution(tiny_lm):
    """The first sampled token's frequencies over 3000 runs match softmax(logits) within 5 standard errors."""
    ids = tiny_lm.tokenizer("xy", return_tensors="pt").input_ids
    with torch.no_grad():
        probs = torch.softmax(tiny_lm.model(ids).logits[0, -1].float() / 2.0, -1)
    n = 3000
    out = generate(tiny_lm.model, ids.expand(n, -1), max_new_tokens=1, temperature=2.0, seed=0)
    freq = torch.bincount(out[:, -1], minlength=probs.numel()).float() / n
    stderr = (probs * (1 - probs) / n).sqrt() + 1e-4
    assert torch.all((freq - probs).abs() < 5 * stderr)
