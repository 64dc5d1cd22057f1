"""Contrastive search against a direct, slow reference computation of the published rule (no cache at all)."""

import pytest
import torch
import torch.nn.functional as F

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.contrastive import contrastive_scores
from runner.infer.generation.generator import Generator, generate


def reference_contrastive(model, ids: torch.Tensor, top_k: int, alpha: float, steps: int) -> list[int]:
    """Every step recomputes everything from scratch: for each of the top-k candidates v, the whole sequence
    plus v is run to get h_v; score = (1 − α)·p(v) − α·max_j cos(h_v, h_j) over all earlier tokens j."""
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(seq, output_hidden_states=True)
            probs = torch.softmax(out.logits[0, -1].float(), -1)
            context = out.hidden_states[-1][0]  # [S,H]
            scores = {}
            for p, v in zip(*probs.topk(top_k)):
                h = model(torch.cat([seq, v.view(1, 1)], dim=1), output_hidden_states=True).hidden_states[-1][0, -1]
                penalty = max(float(F.cosine_similarity(h, c, dim=0)) for c in context)
                scores[int(v)] = (1 - alpha) * float(p) - alpha * penalty
            best = max(scores, key=scores.get)  # ties: the more probable (dicts keep top-k order)
            seq = torch.cat([seq, torch.tensor([[best]])], dim=1)
    return seq[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("top_k, alpha", [(4, 0.6), (3, 0.3), (6, 0.9)])
def test_contrastive_equals_the_direct_reference(tiny_lm, top_k, alpha):
    ids = tiny_lm.tokenizer("The quick brown fox", return_tensors="pt").input_ids
    ours = generate(tiny_lm.model, ids, max_new_tokens=12, penalty_alpha=alpha, top_k=top_k, eos_token_id=[])
    assert ours[0, ids.shape[1]:].tolist() == reference_contrastive(tiny_lm.model, ids, top_k, alpha, 12)


def test_contrastive_with_alpha_zero_is_greedy_and_with_alpha_it_is_not(tiny_lm):
    ids = tiny_lm.tokenizer("hello world, this is", return_tensors="pt").input_ids
    greedy = generate(tiny_lm.model, ids, max_new_tokens=16, temperature=0, eos_token_id=[])
    alpha0 = generate(tiny_lm.model, ids, max_new_tokens=16, penalty_alpha=1e-9, top_k=4, eos_token_id=[])
    contrastive = generate(tiny_lm.model, ids, max_new_tokens=16, penalty_alpha=0.6, top_k=4, eos_token_id=[])
    assert torch.equal(alpha0, greedy)
    assert not torch.equal(contrastive, greedy)


def test_contrastive_scores_formula():
    probs = torch.tensor([0.5, 0.3])
    candidates = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    context = torch.tensor([[3.0, 0.0], [1.0, 1.0]])  # candidate 0 repeats context 0 (cos 1); candidate 1: cos 0.707
    expected = torch.tensor([0.4 * 0.5 - 0.6 * 1.0, 0.4 * 0.3 - 0.6 * 2 ** -0.5])
    assert torch.allclose(contrastive_scores(probs, candidates, context, 0.6), expected)


def test_contrastive_streams_and_continues_a_conversation(tiny_lm):
    """generate_iter yields what generate returns; a second turn equals a fresh run on the whole history."""
    cfg = GenerateConfig(max_new_tokens=6, penalty_alpha=0.5, top_k=3, eos_token_id=[])
    a = tiny_lm.tokenizer("first turn", return_tensors="pt").input_ids
    b = tiny_lm.tokenizer(" then", return_tensors="pt").input_ids
    streamed = list(Generator(tiny_lm.model, cfg).generate_iter(a))
    gen = Generator(tiny_lm.model, cfg)
    out1 = gen.generate(a)
    assert streamed == out1[0, a.shape[1]:].tolist()
    out2 = gen.generate(b)
    expected = reference_contrastive(tiny_lm.model, torch.cat([out1, b], dim=1), 3, 0.5, 6)
    assert out2[0, b.shape[1]:].tolist() == expected


def test_contrastive_rejects_a_batch_and_sampling_settings(tiny_lm):
    enc = tiny_lm.tokenizer(["a", "bc"], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="batch of 1"):
        generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, penalty_alpha=0.5, top_k=4)
    with pytest.raises(ValueError, match="top_k > 1"):
        GenerateConfig(penalty_alpha=0.5)
    with pytest.raises(ValueError, match="top_p"):
        GenerateConfig(penalty_alpha=0.5, top_k=4, top_p=0.9)


def test_contrastive_stops_at_max_seq_len_like_greedy(tiny_lm):
    ids = tiny_lm.tokenizer("abcdef", return_tensors="pt").input_ids  # 6 tokens
    for settings in (dict(temperature=0), dict(penalty_alpha=0.5, top_k=3)):
        gen = Generator(tiny_lm.model, GenerateConfig(max_new_tokens=50, eos_token_id=[], max_seq_len=10, **settings))
        out = gen.generate(ids)
        assert out.shape[1] == 10 and gen.stats.stop_reasons == ["max_seq_len"]
