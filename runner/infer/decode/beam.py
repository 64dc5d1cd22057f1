"""Beam search over our cache kinds, step for step the rule transformers 5 applies (so outputs are token-equal).

Per step, for B prompts × K beams (shapes in comments):
    log_softmax → penalties → + running scores → top 2K of K·V → split into running and finished hypotheses
    → reorder the cache to the surviving beams → stop when no running beam can improve the finished ones.
A finished hypothesis scores sum(logprobs) / new_tokens ** length_penalty. `early_stopping` as in transformers:
True stops once K hypotheses finished; False stops when the best running beam, at its current length, cannot beat
the worst finished one; "never" uses the longest possible length for that estimate when length_penalty > 0.
Owns the search only: the prefill, positions and window bookkeeping come from decode.py and window.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.sampling import apply_penalties

NEG = -1.0e9  # transformers' "impossible" score; the same constant keeps ties and sums bit-identical


@dataclass
class BeamResult:
    sequences: torch.Tensor  # [B·R, T+N] prompt then the R best hypotheses per prompt, fill after their end
    scores: torch.Tensor  # [B·R] length-penalised scores, best first within each prompt
    new_tokens: list[int]  # per returned hypothesis


def gather_beams(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B,K,...] tensor, [B,J] beam indices → [B,J,...]."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


class BeamSearch:
    """The state of one beam search over B prompts: running and finished hypotheses and their scores."""

    def __init__(self, prompt: torch.Tensor, config: GenerateConfig, eos_ids: set[int], fill_id: int, max_len: int):
        batch, prompt_len = prompt.shape  # prompt [B,T] (left-padded)
        k, device = config.num_beams, prompt.device
        self.config, self.batch, self.k, self.prompt_len, self.max_len = config, batch, k, prompt_len, max_len
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.keep = max(2, 1 + len(eos_ids)) * k  # candidates per step: enough that K survive even if K hit EOS
        self.top_k_mask = torch.arange(self.keep, device=device) < k
        self.running = torch.full((batch, k, max_len), fill_id, dtype=torch.long, device=device)
        self.running[:, :, :prompt_len] = prompt[:, None, :]
        self.finished = self.running.clone()
        self.running_scores = torch.zeros(batch, k, device=device)
        self.running_scores[:, 1:] = NEG  # only beam 0 expands at first: K copies of one prompt
        self.finished_scores = torch.full((batch, k), NEG, device=device)
        self.finished_lens = torch.zeros(batch, k, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(batch, k, dtype=torch.bool, device=device)
        self.improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
        self.cur_len = prompt_len

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """[B·K,V] logits of the running beams → ([B·K] parent beam of each new running beam, whether to go on)."""
        b, k, cur = self.batch, self.k, self.cur_len
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprobs = apply_penalties(logprobs, self.running.view(b * k, -1)[:, :cur], self.config)
        vocab = logprobs.shape[-1]
        total = (logprobs.view(b, k, vocab) + self.running_scores[:, :, None]).view(b, k * vocab)
        top_scores, top_index = torch.topk(total, self.keep)  # [B,2K]
        parent, token = top_index // vocab, top_index % vocab
        candidates = gather_beams(self.running, parent)  # [B,2K,L]
        candidates[:, :, cur] = token
        hits = torch.isin(token, self.eos) | (cur + 1 >= self.max_len)  # [B,2K] this candidate ends here

        alive = top_scores + hits.to(torch.float32) * NEG
        best = torch.topk(alive, k)[1]  # [B,K]
        self.running = gather_beams(candidates, best)
        self.running_scores = gather_beams(alive, best)
        parents = gather_beams(parent, best) + torch.arange(b, device=parent.device)[:, None] * k
        self._update_finished(candidates, top_scores, hits)

        self.cur_len += 1
        self.improvable = self._can_improve()
        all_done = bool(self.is_finished.all()) and self.config.early_stopping is True
        go_on = bool(self.improvable.any()) and not all_done
        return parents.view(-1), go_on and not bool(hits.all())

    def next_tokens(self) -> torch.Tensor:
        """[B·K] the last token of each running beam (what the next forward feeds)."""
        return self.running[:, :, self.cur_len - 1].reshape(-1)

    def _update_finished(self, candidates: torch.Tensor, top_scores: torch.Tensor, hits: torch.Tensor) -> None:
        """Keep the K best finished hypotheses among the old ones and the top-K candidates that just ended."""
        new_len = self.cur_len + 1 - self.prompt_len
        scores = top_scores / (new_len ** self.config.length_penalty)
        full = self.is_finished.all(dim=-1, keepdim=True) & (self.config.early_stopping is True)
        scores += full.to(torch.float32) * NEG
        scores += (~self.improvable).to(torch.float32) * NEG
        just_finished = hits & self.top_k_mask[None, :]
        scores += (~just_finished) * NEG
        merged_scores = torch.cat([self.finished_scores, scores], dim=1)
        order = torch.topk(merged_scores, self.k)[1]
        self.finished = gather_beams(torch.cat([self.finished, candidates], dim=1), order)
        self.finished_scores = gather_beams(merged_scores, order)
        lens = torch.full_like(just_finished, new_len, dtype=torch.long)
        self.finished_lens = gather_beams(torch.cat([self.finished_lens, lens], dim=1), order)
        self.is_finished = gather_beams(torch.cat([self.is_finished, just_finished], dim=1), order)

    def _can_improve(self) -> torch.Tensor:
        """[B,1] whether the best running beam could still beat the worst finished one (transformers' heuristic)."""
        lp = self.config.length_penalty
        if self.config.early_stopping == "never" and lp > 0.0:
            length = self.max_len - self.prompt_len
        else:
            length = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (length ** lp)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True)[0], NEG)
        return self.improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)

    def result(self) -> BeamResult:
        """The R = num_return_sequences best finished hypotheses per prompt, cut to the longest of them."""
        r = self.config.num_return_sequences
        lens = self.finished_lens[:, :r].reshape(-1)
        end = self.prompt_len + int(lens.max())
        return BeamResult(self.finished[:, :r].reshape(self.batch * r, -1)[:, :end],
                          self.finished_scores[:, :r].reshape(-1), lens.tolist())
