"""Contrastive search (Su et al. 2022, arXiv 2202.06417), which transformers 5 no longer ships in its core.

Each step takes the top_k most probable next tokens v and picks
    argmax_v  (1 − α) · p(v | x<t)  −  α · max_j cos(h_v, h_j)
where h_v is the last layer's hidden state of v fed after the context and h_j those of every earlier token
(prompt included): model confidence minus a degeneration penalty. The k candidates are fed in one forward
through the cache repeated k times, and the chosen one's cache rows, logits and hidden state are kept, so the
chosen token needs no second forward. One sequence at a time (batch 1).
Owns the rule and its per-conversation state (the context's hidden states); changes the decode state only
through its methods (feed_candidates, keep_candidate); the loop is the generator's.
"""

from __future__ import annotations

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import DecodeState
from runner.infer.decode.sampling import apply_penalties


def contrastive_scores(probs: torch.Tensor, candidate_hidden: torch.Tensor, context_hidden: torch.Tensor,
                       alpha: float) -> torch.Tensor:
    """[k] probabilities, [k,H] candidate states, [S,H] context states → [k] scores (higher is better)."""
    candidates = candidate_hidden / candidate_hidden.norm(dim=-1, keepdim=True)
    context = context_hidden / context_hidden.norm(dim=-1, keepdim=True)
    degeneration = (candidates @ context.T).max(dim=-1).values  # [k] most similar earlier token
    return (1.0 - alpha) * probs - alpha * degeneration


class ContrastiveSearch:
    """Chooses each token by contrastive_scores; remembers the hidden states of everything fed so far."""

    def __init__(self, config: GenerateConfig):
        if config.top_k is None or config.penalty_alpha is None:
            raise ValueError("contrastive search needs penalty_alpha and top_k > 1 (GenerateConfig.contrastive)")
        self.config = config
        self.top_k, self.alpha = config.top_k, config.penalty_alpha
        self.context: torch.Tensor | None = None  # [S,H] last-layer hidden states of the context

    def add_context(self, hidden: torch.Tensor) -> None:
        """[1,T,H] hidden states of newly fed tokens (batch 1)."""
        states = hidden[0].float()
        self.context = states if self.context is None else torch.cat([self.context, states], dim=0)

    def choose(self, model, state: DecodeState, sequence: torch.Tensor,
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1,V] logits, [1,L] sequence so far → ([1] chosen token, [1,V] logits after it). The chosen token is
        fed into `state` (its cache already holds it)."""
        probs = torch.softmax(apply_penalties(logits.float(), sequence, self.config), dim=-1)
        top_probs, top_ids = probs[0].topk(self.top_k)  # [k], [k]
        next_logits, hidden = state.feed_candidates(model, top_ids)  # [k,V], [k,1,H]
        assert self.context is not None, "add_context (the prefill's hidden states) before choose"
        best = int(contrastive_scores(top_probs, hidden[:, 0].float(), self.context, self.alpha).argmax())
        state.keep_candidate(best)
        self.add_context(hidden[best:best + 1])
        return top_ids[best:best + 1], next_logits[best:best + 1]
