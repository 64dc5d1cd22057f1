"""Speculative decoding: token-identical to our greedy decode at temperature 0 (any draft, cache kinds with
rollback), the target's distribution under sampling (a stated TV bound), counts, adaptive k and the fallback."""

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from runner.infer.config.decoding import SpeculativeConfig
from runner.infer.generation.generator import generate
from runner.infer.loading.models import load_model
from runner.infer.speculative.generator import FALLBACK_MIN_ROUNDS, SpeculativeGenerator, lookup_proposal
from tests.conftest import TINY_LLAMA

PROMPTS = ["hello world, this is", "The quick brown fox"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny batch-1 forwards: extra threads only contend


def _drafts(tiny_lm, draft_lm):
    return {"random": draft_lm.model, "self": tiny_lm.model, "lookup": "prompt-lookup"}


def _spec(target, draft, ids, mask=None, batched=True, **settings):
    gen = SpeculativeGenerator(target_model=target, draft_model=draft, config=SpeculativeConfig(**settings),
                               batched=batched)
    return gen.generate(ids, mask), gen


@pytest.mark.parametrize("which", ["random", "self", "lookup"])
def test_greedy_matches_our_decode_on_a_padded_batch(tiny_lm, draft_lm, which):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # really padded
    ref = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=30, temperature=0)
    out, gen = _spec(tiny_lm.model, _drafts(tiny_lm, draft_lm)[which], enc.input_ids, enc.attention_mask,
                     spec_k=4, max_new_tokens=30, temperature=0)
    assert torch.equal(out, ref)
    assert gen.stats.drafted > 0 and gen.stats.new_tokens == [30, 30]


@pytest.mark.parametrize("kind", ["fp32", "q8_0", "kivi4", "kivi4:g8:r8", "kivi2:g8:r16", "kivi4:g8:r8:s3",
                                  "kivi2:g8:r16:s5"])
@pytest.mark.parametrize("which", ["random", "self", "lookup"])
def test_greedy_matches_our_decode_through_cache_rollback(tiny_lm, draft_lm, kind, which):
    ids = tiny_lm.tokenizer(["The quick brown fox jumps"], return_tensors="pt").input_ids
    ref = generate(tiny_lm.model, ids, max_new_tokens=40, temperature=0, cache_kind=kind)
    out, gen = _spec(tiny_lm.model, _drafts(tiny_lm, draft_lm)[which], ids, spec_k=4, max_new_tokens=40,
                     temperature=0, cache_kind=kind)
    assert torch.equal(out, ref)
    assert sum(gen.stats.accepted_hist[:4]) > 0 or which == "self"  # some round rejected: a crop really happened


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_target_as_its_own_draft_accepts_everything(tiny_lm, temperature):
    k, rounds = 4, 5
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    out, gen = _spec(tiny_lm.model, tiny_lm.model, ids, spec_k=k, max_new_tokens=rounds * (k + 1),
                     temperature=temperature, seed=3)
    s = gen.stats
    assert out.shape[1] == ids.shape[1] + rounds * (k + 1)
    assert gen.acceptance_rate == 1.0 and s.mean_accepted_length == k
    assert s.accepted_hist == [0] * k + [rounds] and s.k_history == [[k] * rounds]
    assert s.target_forwards == 1 + rounds  # prefill + one verify per round
    assert s.draft_forwards == 1 + rounds * k  # prefill + k proposals per round


def test_without_extra_token_a_full_round_yields_k_tokens(tiny_lm):
    k = 3
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    ref = generate(tiny_lm.model, ids, max_new_tokens=12, temperature=0)
    out, gen = _spec(tiny_lm.model, tiny_lm.model, ids, spec_k=k, max_new_tokens=12, temperature=0,
                     spec_extra_token=False)
    assert torch.equal(out, ref)
    assert gen.stats.k_history == [[k] * 4] and gen.stats.target_forwards == 1 + 4


def test_rows_stop_at_eos_like_our_decode(tiny_lm, draft_lm):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    free = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=20, temperature=0)
    eos = int(free[1, enc.input_ids.shape[1] + 5])  # the 6th token of row 1 becomes EOS
    model = copy.deepcopy(tiny_lm.model)
    model.generation_config.eos_token_id = eos
    ref = generate(model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=20, temperature=0)
    out, gen = _spec(model, draft_lm.model, enc.input_ids, enc.attention_mask, spec_k=4, max_new_tokens=20,
                     temperature=0)
    assert torch.equal(out, ref)
    assert "eos" in gen.stats.stop_reasons and max(gen.stats.new_tokens) <= 20


@pytest.mark.parametrize("vocab", [200, 300])
def test_a_draft_with_another_vocab_size_is_aligned_to_the_target(tiny_lm, vocab):
    draft = load_model(config={**TINY_LLAMA, "vocab_size": vocab, "eos_token_id": 0, "pad_token_id": 0},
                       device="cpu", seed=2).model
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids.clamp(max=vocab - 1)
    ref = generate(tiny_lm.model, ids, max_new_tokens=16, temperature=0)
    out, gen = _spec(tiny_lm.model, draft, ids, spec_k=3, max_new_tokens=16, temperature=0)
    assert torch.equal(out, ref) and gen.stats.drafted > 0


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    seq = torch.tensor([5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 1, 2, 3])
    assert lookup_proposal(seq, 2).tolist() == [4, 7]  # the latest earlier "1 2 3" is followed by 4 7
    assert lookup_proposal(torch.tensor([1, 2, 3, 4]), 3).tolist() == []  # nothing repeats
    assert lookup_proposal(torch.tensor([8, 6, 0, 8]), 3).tolist() == [6, 0, 8]  # falls back to a 1-gram


def _vocab8_pair():
    """A tiny target over 8 tokens with a sharpened head, and a draft = the target with a noisy head: their
    distributions overlap partly, so acceptances and rejections (residual draws) both happen often."""
    lm = load_model(config={**TINY_LLAMA, "vocab_size": 8, "eos_token_id": None, "pad_token_id": 0},
                    device="cpu", seed=0)
    target = lm.model
    draft = copy.deepcopy(target)
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
        draft.lm_head.weight.copy_(target.lm_head.weight + target.lm_head.weight.std() * noise)
    return target, draft


def _first_two_joint(model, prompt: torch.Tensor, temperature: float, top_k) -> torch.Tensor:
    """The model's own sampling distribution of the first two tokens, [8,8], from its filtered softmax."""
    from runner.infer.config.decoding import GenerateConfig
    from runner.infer.decode.sampling import process_logits

    cfg = GenerateConfig(temperature=temperature, top_k=top_k)
    with torch.no_grad():
        ids = torch.cat([prompt.expand(8, -1), torch.arange(8)[:, None]], dim=1)  # [8,T+1]
        logits = model(ids).logits.float()
        first = torch.softmax(process_logits(logits[:1, -2], ids[:1], cfg), -1)[0]  # [8]
        second = torch.softmax(process_logits(logits[:, -1], ids, cfg), -1)  # [8,8]
    return first[:, None] * second


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of counts [K] against probs [K]; cells expecting < 5 are pooled into one. → (stat, df)."""
    expected, observed = probs.flatten() * counts.sum(), counts.flatten().float()
    big = expected >= 5
    stat, cells = float(((observed[big] - expected[big]) ** 2 / expected[big]).sum()), int(big.sum())
    if (~big).any():
        pooled_e, pooled_o = float(expected[~big].sum()), float(observed[~big].sum())
        stat, cells = stat + (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-12), cells + 1
    return stat, cells - 1


def _chi_square_quantile(df: int, z: float = 3.719) -> float:
    """Wilson–Hilferty: the chi-square quantile at the normal quantile z (3.719 → 1 − 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("draft_kind,method,temperature,top_k,batched", [
    ("model", "reject_sampling", 1.0, None, True), ("model", "reject_sampling", 1.0, None, False),
    ("model", "greedy", 0.8, 5, True), ("lookup", "reject_sampling", 1.0, None, True)])
def test_sampled_tokens_follow_the_targets_distribution(draft_kind, method, temperature, top_k, batched):
    """n = 1000 samples of the first two tokens (64 cells, k = 2 so both the residual draw at either position and
    the bonus token are exercised) against the target's own filtered joint p(a)·p(b|a): Pearson chi-square below
    its 1 − 1e-4 quantile (a false failure 1 in 10,000). Drawing the correction from p instead of the residual,
    or accepting with p instead of p/q, gives a statistic 1.5–3.5× the threshold here; the same counts tested
    against the draft's distribution must fail, so a sampler that let q through would be caught.
    Batched, the n rows are one batch: rows accept different numbers in the first round, so the second token of
    many rows is verified over a cache with holes (spec_batch / ragged); row by row, each row alone."""
    n = 1000
    target, draft = _vocab8_pair()
    prompt = torch.tensor([[1, 2, 3, 1, 2]])  # prompt lookup finds "1 2" → proposes 3, 1
    p = _first_two_joint(target, prompt, temperature, top_k)
    q = _first_two_joint(draft, prompt, temperature, top_k)
    out, gen = _spec(target, draft if draft_kind == "model" else "prompt-lookup", prompt.expand(n, -1),
                     batched=batched, spec_k=2, max_new_tokens=3, temperature=temperature, top_k=top_k,
                     spec_method=method, seed=11)
    assert gen.stats.batched == batched
    counts = torch.bincount(out[:, 5] * 8 + out[:, 6], minlength=64)
    stat, df = _chi_square(counts, p)
    assert stat < _chi_square_quantile(df), (stat, df)
    if draft_kind == "model":
        stat_q, df_q = _chi_square(counts, q)
        assert stat_q > _chi_square_quantile(df_q), (stat_q, df_q)
    assert 0.05 < gen.acceptance_rate < 0.95  # rejections and acceptances both happened


def test_adaptive_k_shrinks_on_rejection_and_grows_on_acceptance(tiny_lm, draft_lm):
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    _, bad = _spec(tiny_lm.model, draft_lm.model, ids, spec_k=4, spec_k_adaptive=True, max_new_tokens=20,
                   temperature=0)
    assert bad.stats.k_history[0][:4] == [4, 3, 2, 1]  # k −= 1 after each round accepting < half
    _, good = _spec(tiny_lm.model, tiny_lm.model, ids, spec_k=2, spec_k_adaptive=True, max_new_tokens=40,
                    temperature=0)
    assert good.stats.k_history[0][:4] == [2, 3, 4, 4]  # k += 1 after full rounds, capped at 2·spec_k


def test_fallback_to_target_only_below_the_acceptance_threshold(tiny_lm, draft_lm):
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    ref = generate(tiny_lm.model, ids, max_new_tokens=30, temperature=0)
    out, gen = _spec(tiny_lm.model, draft_lm.model, ids, spec_k=3, max_new_tokens=30, temperature=0,
                     spec_disable_below_accept=0.99)
    assert torch.equal(out, ref)
    assert gen.stats.fallback_round == [FALLBACK_MIN_ROUNDS] and gen.stats.rounds == FALLBACK_MIN_ROUNDS
    assert gen.stats.target_only_steps > 0
    _, kept = _spec(tiny_lm.model, tiny_lm.model, ids, spec_k=3, max_new_tokens=30, temperature=0,
                    spec_disable_below_accept=0.99)
    assert kept.stats.fallback_round == [None] and kept.stats.target_only_steps == 0


def test_config_takes_the_seed_names_and_rejects_the_rest():
    cfg = SpeculativeConfig(spec_k=4, spec_k_adaptive=True, spec_method="greedy", spec_extra_token=False,
                            spec_disable_below_accept=0.3, max_new_tokens=8, temperature=0.8, top_k=5, top_p=0.9,
                            cache_kind="q8")
    assert cfg.spec_k == 4 and cfg.cache_kind == "q8"
    for bad in [{"spec_kk": 4}, {"spec_method": "typical"}, {"spec_k": 0}, {"spec_disable_below_accept": 1.5},
                {"cache_kind": "q3"}, {"cache_kind": "auto"}]:
        with pytest.raises(ValidationError):
            SpeculativeConfig(**bad)
    with pytest.raises(ValueError, match="prompt-lookup"):
        SpeculativeGenerator(target_model=torch.nn.Linear(1, 1), draft_model="lookup")


def test_max_seq_len_stops_where_our_decode_stops(tiny_lm, draft_lm):
    ids = tiny_lm.tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    limit = ids.shape[1] + 7
    ref = generate(tiny_lm.model, ids, max_new_tokens=30, temperature=0, max_seq_len=limit)
    out, gen = _spec(tiny_lm.model, tiny_lm.model, ids, spec_k=4, max_new_tokens=30, temperature=0, max_seq_len=limit)
    assert torch.equal(out, ref) and out.shape[1] == limit
    assert gen.stats.stop_reasons == ["max_seq_len"]
