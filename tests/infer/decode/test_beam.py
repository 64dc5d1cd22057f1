"""Beam search against transformers' own (token-exact), through our cache kinds, and its bookkeeping."""

import pytest
import torch

from runner.infer.cache.registry import make_cache
from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator, generate

PROMPTS = ["hello world, this is", "a", "The quick brown fox"]


def _batch(lm, prompts):
    return lm.tokenizer(prompts, return_tensors="pt", padding=True)


def _eos_that_beams_reach(lm, enc) -> int:
    """A token the 4-beam search emits early, so that hypotheses really finish (a random model never picks EOS)."""
    free = generate(lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=6, num_beams=4,
                    eos_token_id=[])
    return int(free[0, enc.input_ids.shape[1] + 2])


SETTINGS = [
    dict(num_beams=4),
    dict(num_beams=3, num_return_sequences=3, length_penalty=0.5),
    dict(num_beams=4, early_stopping=True, length_penalty=2.0),
    dict(num_beams=2, early_stopping="never", length_penalty=-1.0),
    dict(num_beams=4, no_repeat_ngram_size=2, repetition_penalty=1.3),
]


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "padded-batch"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
def test_beam_search_equals_transformers(tiny_lm, prompts, settings, with_eos):
    enc = _batch(tiny_lm, prompts)
    eos = _eos_that_beams_reach(tiny_lm, enc) if with_eos else []
    ours = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=14,
                    eos_token_id=eos, **settings)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=14, do_sample=False, eos_token_id=eos or None, **settings)
    assert ours.shape[0] == len(prompts) * settings.get("num_return_sequences", 1)
    assert torch.equal(ours, hf)


def test_beams_really_finish_early_on_eos(tiny_lm):
    enc = _batch(tiny_lm, PROMPTS[:1])
    eos = _eos_that_beams_reach(tiny_lm, enc)
    gen = Generator(tiny_lm.model, GenerateConfig(num_beams=4, max_new_tokens=14, eos_token_id=eos,
                                                  num_return_sequences=2))
    out = gen.generate(enc.input_ids)
    assert "eos" in gen.stats.stop_reasons and min(gen.stats.new_tokens) < 14
    assert gen.stats.scores == sorted(gen.stats.scores, reverse=True)
    row = gen.stats.stop_reasons.index("eos")
    assert int(out[row, enc.input_ids.shape[1] + gen.stats.new_tokens[row] - 1]) == eos


@pytest.mark.parametrize("kind", ["fp16", "q8_0", "nf4", "kivi4"])
def test_beam_search_reorders_every_cache_kind(tiny_lm, kind):
    """Same tokens as transformers' beam search over the same cache kind: reorder_cache works for each layer."""
    enc = _batch(tiny_lm, PROMPTS)
    ours = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=10,
                    num_beams=3, cache_kind=kind)
    hf = tiny_lm.model.generate(**enc, max_new_tokens=10, do_sample=False, num_beams=3,
                                cache=make_cache(kind, tiny_lm.model))
    assert torch.equal(ours, hf)


def test_beam_search_does_not_stream(tiny_lm):
    gen = Generator(tiny_lm.model, GenerateConfig(num_beams=2))
    with pytest.raises(ValueError, match="beam search"):
        next(gen.generate_iter(_batch(tiny_lm, PROMPTS[:1]).input_ids))


@pytest.mark.parametrize("settings, message", [
    (dict(num_beams=2, temperature=0.7), "temperature"),
    (dict(num_beams=2, top_p=0.9), "top_p"),
    (dict(num_beams=2, stop_strings=["x"]), "stop_strings"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
])
def test_beam_settings_that_do_not_combine_are_rejected(settings, message):
    with pytest.raises(ValueError, match=message):
        GenerateConfig(**settings)


@pytest.mark.slow
def test_beam_search_equals_transformers_on_smollm2(smollm):
    enc = smollm.tokenizer(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True)
    settings = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, length_penalty=1.0)
    ours = generate(smollm.model, enc.input_ids, attention_mask=enc.attention_mask, **settings)
    hf = smollm.model.generate(**enc, do_sample=False, **settings)
    assert torch.equal(ours, hf)
