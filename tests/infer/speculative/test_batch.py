"""Batched speculative decoding: each row of a ragged batch is the target's greedy output (left padding, EOS in
different rounds, max_seq_len reached by one row only, every per-token cache kind), holes in a ragged cache are
invisible to attention, KIVI is refused and decoded row by row, adaptive k and the fallback act per batch."""

import copy

import pytest
import torch

from runner.infer.cache.ragged import RaggedCache, ragged_reason
from runner.infer.cache.registry import make_cache
from runner.infer.config.decoding import SpeculativeConfig
from runner.infer.generation.generator import generate
from runner.infer.speculative.generator import SpeculativeGenerator
from runner.infer.speculative.rounds import FALLBACK_MIN_ROUNDS

PROMPTS = ["hello world, this is", "The quick brown fox jumps over", "a b a b a b a", "Once"]
PER_TOKEN_KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1", "nf4"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny batch-1 forwards: extra threads only contend


def _spec(target, draft, enc, **settings):
    gen = SpeculativeGenerator(target_model=target, draft_model=draft, config=SpeculativeConfig(**settings))
    return gen.generate(enc.input_ids, enc.attention_mask), gen


def _enc(tiny_lm, prompts=PROMPTS):
    enc = tiny_lm.tokenizer(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # really left-padded
    return enc


@pytest.mark.parametrize("kind", PER_TOKEN_KINDS)
@pytest.mark.parametrize("which", ["random", "lookup"])
def test_every_row_is_the_targets_greedy_output(tiny_lm, draft_lm, kind, which):
    enc = _enc(tiny_lm)
    ref = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=24,
                   temperature=0, cache_kind=kind)
    draft = draft_lm.model if which == "random" else "prompt-lookup"
    out, gen = _spec(tiny_lm.model, draft, enc, spec_k=4, max_new_tokens=24, temperature=0, cache_kind=kind)
    assert gen.stats.batched
    assert torch.equal(out, ref)
    assert gen.stats.drafted > 0 and sum(gen.stats.accepted_hist[:4]) > 0  # rejections: holes were made


def test_a_self_draft_accepts_everything_in_one_forward_per_round(tiny_lm):
    enc = _enc(tiny_lm)
    k, rounds = 3, 4
    _, gen = _spec(tiny_lm.model, tiny_lm.model, enc, spec_k=k, max_new_tokens=rounds * (k + 1), temperature=0)
    s = gen.stats
    assert s.batched and s.acceptance_rate == 1.0 and s.row_acceptance == [1.0] * len(PROMPTS)
    assert s.target_forwards == 1 + rounds  # prefill + ONE verify per round for the whole batch
    assert s.draft_forwards == 1 + rounds * k
    assert s.k_history == [[k] * rounds] * len(PROMPTS)


def test_rows_stop_at_eos_in_different_rounds(tiny_lm, draft_lm):
    enc = _enc(tiny_lm)
    free = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=20,
                    temperature=0)
    new = free[:, enc.input_ids.shape[1]:]
    eos = int(new[1, 5])  # row 1 stops at its 6th token; other rows stop wherever that token first appears
    model = copy.deepcopy(tiny_lm.model)
    model.generation_config.eos_token_id = eos
    ref = generate(model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=20, temperature=0)
    for draft in (draft_lm.model, "prompt-lookup"):
        out, gen = _spec(model, draft, enc, spec_k=3, max_new_tokens=20, temperature=0)
        assert torch.equal(out, ref)
        assert gen.stats.stop_reasons.count("eos") >= 1 and "max_new_tokens" in gen.stats.stop_reasons
        assert len(set(gen.stats.new_tokens)) > 1  # rows left the batch at different times


def test_max_seq_len_reached_by_one_row_only(tiny_lm, draft_lm):
    enc = _enc(tiny_lm, ["The quick brown fox jumps over the lazy dog", "Once"])
    lengths = enc.attention_mask.sum(-1).tolist()
    limit = max(lengths) + 5
    out, gen = _spec(tiny_lm.model, draft_lm.model, enc, spec_k=4, max_new_tokens=12, temperature=0,
                     max_seq_len=limit)
    assert gen.stats.stop_reasons == ["max_seq_len", "max_new_tokens"] and gen.stats.new_tokens == [5, 12]
    for r in range(2):  # each row against its own unpadded greedy decode under the same limit
        ids = enc.input_ids[r][enc.attention_mask[r].bool()][None]
        ref = generate(tiny_lm.model, ids, max_new_tokens=12, temperature=0, max_seq_len=limit)
        new = out[r, enc.input_ids.shape[1]:][:gen.stats.new_tokens[r]]
        assert torch.equal(new, ref[0, ids.shape[1]:])


@pytest.mark.parametrize("kind", PER_TOKEN_KINDS)
def test_holes_are_invisible_to_attention(tiny_lm, kind):
    """Two rows fed 4 columns; row 0 keeps 1, row 1 keeps 3 (holes after them); one more token each. Each row's
    logits equal those of a batch-1 cache fed only that row's kept tokens (float tolerance, same argmax)."""
    model = tiny_lm.model
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    chunk = torch.tensor([[11, 12, 13, 14], [15, 16, 17, 18]])
    ragged = RaggedCache(make_cache(kind, model))
    with torch.no_grad():
        ragged.feed(model, prompt, torch.ones_like(prompt))
        ragged.feed(model, chunk, torch.ones_like(chunk), keep=4)
        ragged.keep_first(4, torch.tensor([1, 3]))
        assert ragged.mask.tolist() == [[1] * 4 + [0, 0], [1] * 6] and ragged.seen.tolist() == [4, 6]
        assert ragged.cache.get_seq_length() == 6  # the column that was a hole in both rows is cropped
        last = torch.tensor([[20], [21]])
        logits = ragged.feed(model, last, torch.ones_like(last))[:, -1]
        for r, kept in enumerate([1, 3]):
            alone = RaggedCache(make_cache(kind, model))
            ids = torch.cat([prompt[r], chunk[r, :kept], last[r]])[None]
            expected = alone.feed(model, ids, torch.ones_like(ids))[0, -1]
            assert torch.allclose(logits[r], expected, atol=1e-4, rtol=1e-4)
            assert int(logits[r].argmax()) == int(expected.argmax())


@pytest.mark.parametrize("kind", ["kivi4:g8:r8", "kivi2:g8:r16"])
def test_kivi_is_refused_batched_and_decoded_row_by_row_exactly(tiny_lm, draft_lm, kind):
    assert "KIVI" in ragged_reason(make_cache(kind, tiny_lm.model))
    enc = _enc(tiny_lm, PROMPTS[:2])
    out, gen = _spec(tiny_lm.model, draft_lm.model, enc, spec_k=4, max_new_tokens=20, temperature=0, cache_kind=kind)
    assert not gen.stats.batched
    for r in range(2):
        ids = enc.input_ids[r][enc.attention_mask[r].bool()][None]
        ref = generate(tiny_lm.model, ids, max_new_tokens=20, temperature=0, cache_kind=kind)
        assert torch.equal(out[r, enc.input_ids.shape[1]:], ref[0, ids.shape[1]:])


def test_adaptive_k_and_fallback_act_on_the_whole_batch(tiny_lm, draft_lm):
    enc = _enc(tiny_lm, PROMPTS[:2])
    _, good = _spec(tiny_lm.model, tiny_lm.model, enc, spec_k=2, spec_k_adaptive=True, max_new_tokens=40,
                    temperature=0)
    assert good.stats.k_history[0][:4] == [2, 3, 4, 4] == good.stats.k_history[1][:4]
    ref = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=30, temperature=0)
    out, bad = _spec(tiny_lm.model, draft_lm.model, enc, spec_k=3, max_new_tokens=30, temperature=0,
                     spec_disable_below_accept=0.99)
    assert torch.equal(out, ref)
    assert bad.stats.fallback_round == [FALLBACK_MIN_ROUNDS] * 2
    assert [len(h) for h in bad.stats.k_history] == [FALLBACK_MIN_ROUNDS] * 2 and bad.stats.target_only_steps > 0


def test_batched_and_row_by_row_agree(tiny_lm, draft_lm):
    enc = _enc(tiny_lm)
    settings = SpeculativeConfig(spec_k=4, max_new_tokens=16, temperature=0)
    gens = [SpeculativeGenerator(target_model=tiny_lm.model, draft_model=draft_lm.model, config=settings,
                                 batched=batched) for batched in (True, False)]
    outs = [gen.generate(enc.input_ids, enc.attention_mask) for gen in gens]
    assert torch.equal(*outs)
    # the batched draft cache saw each row's own context: the same proposals, so the same acceptances per row
    assert gens[0].stats.row_accepted == gens[1].stats.row_accepted
    assert gens[0].stats.k_history == gens[1].stats.k_history


def test_one_token_prompts_and_a_row_that_is_all_padding_but_one(tiny_lm, draft_lm):
    """No prefill at all (T = 1), and a row whose prefill columns are all padding: both stay exact."""
    for ids, mask in [(torch.tensor([[5], [9]]), torch.ones(2, 1, dtype=torch.long)),
                      (torch.tensor([[0, 0, 0, 7], [5, 6, 7, 8]]), torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]]))]:
        ref = generate(tiny_lm.model, ids, attention_mask=mask, max_new_tokens=12, temperature=0)
        gen = SpeculativeGenerator(target_model=tiny_lm.model, draft_model=draft_lm.model,
                                   config=SpeculativeConfig(spec_k=3, max_new_tokens=12, temperature=0))
        assert torch.equal(gen.generate(ids, mask), ref) and gen.stats.batched
