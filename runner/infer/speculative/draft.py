"""The draft side of speculative decoding, as one object both loops (row by row, batched) are handed.

Owns `Draft`: a draft model that shares the target's tokenizer (its tokens fed through `tokens`, which maps what its
smaller vocabulary cannot embed to 0), prompt lookup, or a draft with another tokenizer that proposes through text
(`text.TextDraft`). The last two propose as a function of a row's tokens alone (`propose`); a draft model's
proposals come from its own cache, which the loop that drives it makes and feeds.
Does not know about verification, caches of the target, or generators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runner.infer.speculative.rounds import lookup_proposal
from runner.infer.speculative.text import TextDraft

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROMPT_LOOKUP = "prompt-lookup"


class Draft:
    """Where draft tokens come from: `model` (a draft model sharing the target's tokenizer), else `text` (a draft
    with another tokenizer), else prompt lookup."""

    def __init__(self, model: PreTrainedModel | None = None, text: TextDraft | None = None):
        if model is not None and text is not None:
            raise ValueError("a draft is a model, a text draft or prompt lookup, not two of them")
        self.model, self.text = model, text
        self.vocab = 0  # rows the draft model can embed
        if model is not None:
            rows = model.get_input_embeddings().weight
            assert isinstance(rows, torch.Tensor)  # an embedding's weight (nn.Module's getattr may be a module)
            self.vocab = rows.shape[0]

    @property
    def lookup(self) -> bool:
        return self.model is None and self.text is None

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target tokens as the draft model is fed them: those it cannot embed (a smaller vocabulary) as 0 (exactness
        holds, acceptance drops)."""
        return tokens.masked_fill(tokens >= self.vocab, 0)

    def propose(self, row: int, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Without a draft model: ≤ k tokens [k'] proposed from row `row`'s tokens [L] alone (prompt lookup, or the
        text draft), verified with q one-hot at each proposed token."""
        return lookup_proposal(seq, k) if self.text is None else self.text.propose(row, seq, k)

    def reset(self) -> None:
        """Forget every row (a new `.generate()` call)."""
        if self.text is not None:
            self.text.reset()

    @property
    def text_forwards(self) -> int:
        """Forwards the text draft ran since the last reset (its own batch-1 ones; 0 without a text draft)."""
        return self.text.forwards if self.text is not None else 0
