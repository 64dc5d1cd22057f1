"""Drafts with another tokenizer (spec_text): tokens travel as text, the output stays the target's greedy output
(batch 1 and a left-padded batch), a draft that means the same as the target is accepted through the text
mapping, and the step's zoo pair (slow) is exact."""

import copy

import pytest
import torch

from runner.infer.config.decoding import SpeculativeConfig
from runner.infer.generation.generator import generate
from runner.infer.loading.models import byte_tokenizer, load_model
from runner.infer.speculative.generator import SpeculativeGenerator
from runner.infer.speculative.text import TextDraft, same_tokenizer, shared_prefix
from tests.conftest import TINY_LLAMA

PROMPTS = ["the theme of the thesis is", "hello there"]


def permuted_tokenizer(seed: int = 0):
    """The byte tokenizer with its 256 byte ids shuffled: the same text pieces under other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = byte_tokenizer()
    alphabet = sorted(base.get_vocab(), key=base.get_vocab().get)[:256]
    order = torch.randperm(256, generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = {alphabet[old]: new for new, old in enumerate(order)} | {"<pad>": 256, "<eos>": 257}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>"), order


def merged_tokenizer():
    """A byte-level BPE with a few merges ("th", "the", "he", "is", " t"): other ids and other boundaries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = byte_tokenizer()
    alphabet = sorted(base.get_vocab(), key=base.get_vocab().get)[:256]
    merges = [("t", "h"), ("th", "e"), ("h", "e"), ("i", "s"), ("Ġ", "t")]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab |= {"<pad>": len(vocab), "<eos>": len(vocab) + 1}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny batch-1 forwards: extra threads only contend


def _spec(lm, draft, draft_tok, enc, **settings):
    gen = SpeculativeGenerator(target_model=lm.model, draft_model=draft, tokenizer=lm.tokenizer,
                               draft_tokenizer=draft_tok, config=SpeculativeConfig(**settings))
    return gen.generate(enc.input_ids, enc.attention_mask), gen


def test_the_helpers():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([], [1]) == 0
    tok = byte_tokenizer()
    assert same_tokenizer(tok, byte_tokenizer()) and not same_tokenizer(tok, merged_tokenizer())
    assert merged_tokenizer().encode("the theme") != tok.encode("the theme")  # really other boundaries


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_a_draft_with_other_boundaries_keeps_the_targets_greedy_output(tiny_lm, prompts):
    draft_tok = merged_tokenizer()
    draft = load_model(config={**TINY_LLAMA, "vocab_size": len(draft_tok), "eos_token_id": draft_tok.eos_token_id,
                               "pad_token_id": draft_tok.pad_token_id}, device="cpu", seed=3).model
    enc = tiny_lm.tokenizer(prompts, return_tensors="pt", padding=True)
    ref = generate(tiny_lm.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=24,
                   temperature=0)
    out, gen = _spec(tiny_lm, draft, draft_tok, enc, spec_k=4, max_new_tokens=24, temperature=0)
    assert gen.text_draft is not None and gen.stats.batched == (len(prompts) > 1)
    assert torch.equal(out, ref)
    assert gen.stats.drafted > 0 and gen.stats.draft_forwards > 0


def test_a_draft_that_means_the_same_is_accepted_through_text(tiny_lm):
    """A target that writes printable ASCII only (the head rows of every other id copy the row of id 0, '!', so
    they never win argmax), and as draft the same weights under shuffled byte ids: every proposal is the target's
    greedy continuation carried through text, so nearly all are accepted; the output is exact."""
    target = copy.deepcopy(tiny_lm.model)
    with torch.no_grad():
        target.lm_head.weight[94:] = target.lm_head.weight[0]  # ids 0..93: '!'..'~'
    draft_tok, order = permuted_tokenizer()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for weight in (draft.model.embed_tokens.weight, draft.lm_head.weight):
            weight[:256] = weight[:256][torch.tensor(order)].clone()  # new id i means old id order[i]
    enc = tiny_lm.tokenizer(["aaaa bbbb aaaa bbbb aaaa"], return_tensors="pt")
    ref = generate(target, enc.input_ids, max_new_tokens=20, temperature=0)
    assert int(ref[0, enc.input_ids.shape[1]:].max()) < 94  # printable ASCII: text round trips losslessly
    lm = copy.copy(tiny_lm)
    lm.model = target
    out, gen = _spec(lm, draft, draft_tok, enc, spec_k=3, max_new_tokens=20, temperature=0)
    assert torch.equal(out, ref)
    assert gen.acceptance_rate > 0.9, gen.stats.as_dict()


def test_text_draft_needs_the_targets_tokenizer(tiny_lm):
    with pytest.raises(ValueError, match="target's tokenizer"):
        TextDraft(tiny_lm.model, merged_tokenizer(), None)


@pytest.mark.slow
def test_smollm2_drafts_for_qwen_through_text():
    """The manifest's pair, smaller: a SmolLM2-135M draft proposes for the Qwen2.5-Coder-0.5B target."""
    target = load_model("zoo:qwen2.5-coder-0.5b", dtype="bfloat16", device="cpu")
    draft = load_model("zoo:smollm2-135m", dtype="bfloat16", device="cpu")
    enc = target.tokenizer(["def fibonacci(n):\n", "# Sum a list\n"], return_tensors="pt", padding=True)
    ref = generate(target.model, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=16, temperature=0)
    out, gen = _spec(target, draft.model, draft.tokenizer, enc, spec_k=4, max_new_tokens=16, temperature=0)
    assert torch.equal(out, ref)
    assert gen.stats.accepted > 0


def test_sampled_tokens_through_a_text_draft_follow_the_targets_distribution(tiny_lm):
    """The sampling half of the text-draft argument: a text draft's proposal is a deterministic function of the
    row's tokens, so reject_sampling must emit the target's own samples. n = 1000 rows in one batch, the first two
    new tokens (k = 2: residual draws at either position and the bonus token) against the target's joint
    p(a)·p(b|a) over all 258² pairs (cells expecting < 5 pooled): Pearson chi-square below its 1 − 1e-4 quantile.
    The draft is the target under shuffled byte ids with a noisy head, so its proposals cross the text mapping and
    are accepted only some of the time. Drawing a rejection's correction from p instead of the residual gives a
    statistic 1.7× the threshold here."""
    from tests.infer.speculative.test_generator import _chi_square, _chi_square_quantile

    n = 1000
    target = copy.deepcopy(tiny_lm.model)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # a peaked distribution: few cells carry most of the mass
    draft_tok, order = permuted_tokenizer()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(7))
        draft.lm_head.weight.add_(draft.lm_head.weight.std() * noise)
        for weight in (draft.model.embed_tokens.weight, draft.lm_head.weight):
            weight[:256] = weight[:256][torch.tensor(order)].clone()
    prompt = tiny_lm.tokenizer(["abc abc ab"], return_tensors="pt").input_ids  # [1,T]
    vocab = target.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(target(prompt).logits[0, -1].float(), -1)  # [V]
        ids = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V,T+1]
        second = torch.softmax(target(ids).logits[:, -1].float(), -1)  # [V,V]
    p = first[:, None] * second
    lm = copy.copy(tiny_lm)
    lm.model = target
    enc = tiny_lm.tokenizer(["abc abc ab"] * n, return_tensors="pt")
    out, gen = _spec(lm, draft, draft_tok, enc, spec_k=2, max_new_tokens=2, temperature=1.0,
                     spec_method="reject_sampling", seed=13)
    t = prompt.shape[1]
    counts = torch.bincount(out[:, t] * vocab + out[:, t + 1], minlength=vocab * vocab)
    stat, df = _chi_square(counts, p)
    assert stat < _chi_square_quantile(df), (stat, df)
    assert 0.05 < gen.acceptance_rate < 0.95, gen.stats.as_dict()  # acceptances and rejections both happened
