"""Drafts that speak another tokenizer: the draft's tokens reach the target as text (as in transformers'
universal assisted generation), so a SmolLM2 draft (49k vocabulary) can propose for a Qwen target (151k).

Owns `TextDraft`: per row, the draft's own token sequence and batch-1 cache, and one proposal (greedy):
    target tokens [L] → text (target tokenizer) → draft tokens (draft tokenizer; the whole text re-encoded)
    → the draft cache keeps the longest common prefix with what it held (crop) and takes the rest
    → k greedy draft tokens → their text (decoded after the context; a trailing partial character dropped)
    → encoded by the target tokenizer → ≤ k target tokens.
The proposal is a deterministic function of the row's tokens so far, so the generator verifies it as it verifies
prompt lookup (q one-hot at the proposed token): at temperature 0 the output is the target's greedy output; under
reject_sampling a token x is accepted with probability p(x) and a rejection draws from p with x removed, which
is the target's own distribution (the argument, and its statistical test, are prompt lookup's). Text that the
two tokenizers split differently costs acceptance, never exactness.
Does not know about verification, batches of caches or timing.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from runner.infer.cache.registry import make_cache
from runner.infer.decode.forward import forward


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (then a draft's tokens are the target's)."""
    return a is b or (a is not None and b is not None and a.get_vocab() == b.get_vocab())


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TextDraft:
    """A draft model with its own tokenizer; `propose(row, seq, k)` → ≤ k target tokens. `forwards` counts."""

    def __init__(self, model, draft_tokenizer, target_tokenizer, cache_kind: str | None = None):
        if target_tokenizer is None:
            raise ValueError("a draft with another tokenizer needs the target's tokenizer: "
                             "SpeculativeGenerator(..., tokenizer=target_tokenizer, draft_tokenizer=...)")
        self.model, self.tokenizer, self.target_tokenizer = model.eval(), draft_tokenizer, target_tokenizer
        self.cache_kind, self.forwards = cache_kind, 0
        self.device = next(model.parameters()).device
        self.rows: dict[int, tuple[list[int], Cache]] = {}  # row → (draft tokens its cache holds, cache)

    def reset(self) -> None:
        """Forget every row (a new `.generate()` call)."""
        self.rows, self.forwards = {}, 0

    def propose(self, row: int, seq: torch.Tensor, k: int) -> torch.Tensor:
        """[L] target tokens of `row` → ≤ k proposed target tokens [k']."""
        text = self.target_tokenizer.decode(seq.tolist())
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids or k <= 0:
            return seq[:0]
        drafted = self._draft(row, ids, k)
        context = self.tokenizer.decode(ids)
        whole = self.tokenizer.decode(ids + drafted)
        new_text = whole[len(context):] if whole.startswith(context) else self.tokenizer.decode(drafted)
        proposal = self.target_tokenizer.encode(new_text.rstrip("\ufffd"), add_special_tokens=False)[:k]
        return torch.tensor(proposal, dtype=torch.long, device=seq.device)

    def _draft(self, row: int, ids: list[int], k: int) -> list[int]:
        """Greedy k draft tokens after `ids`, reusing the row's cache up to the common prefix."""
        held, cache = self.rows.get(row) or ([], make_cache(self.cache_kind, self.model))
        keep = min(shared_prefix(held, ids), len(ids) - 1)  # at least one token is fed: its logits start drafting
        if len(held) > keep:
            cache.crop(keep - len(held))
        logits = self._feed(cache, ids[keep:], keep)
        drafted: list[int] = []
        for i in range(k):
            drafted.append(int(logits.argmax()))
            if i + 1 < k:
                logits = self._feed(cache, drafted[-1:], len(ids) + i)
        self.rows[row] = (ids + drafted[:-1], cache)
        return drafted

    def _feed(self, cache, tokens: list[int], past: int) -> torch.Tensor:
        """[t] draft tokens after `past` cached ones → the draft's logits at the last [V']."""
        self.forwards += 1
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1,t]
        mask = torch.ones(1, past + len(tokens), dtype=torch.long, device=self.device)
        positions = torch.arange(past, past + len(tokens), device=self.device)[None]
        return forward(self.model, ids, mask, positions, cache)[0][0]
