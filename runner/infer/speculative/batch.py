"""Batched speculative decoding: every round drafts for all live rows and verifies them in one target forward.

Owns the batched loop that `SpeculativeGenerator.generate` runs for a batch of more than one row (shapes in
comments, b = live rows, w = the widest draft of the round):
    prefill both caches with the prompts minus their last token (left padding kept as masked columns)
    → propose: the draft catches up on what it has not seen ([b,≤2] chunk, holes on the left), then drafts w
      tokens for every row in w batched forwards (or, per row, prompt lookup or a draft with another tokenizer
      through text, `text.TextDraft`: its batch-1 draft forwards run row by row; rows with fewer pad the round)
    → verify: one target forward over [pending, x_1..x_w] [b,w+1] → p [b,w+1,V]
    → accept per row (the same rules as one row: spec_rounds) → row r keeps n_r + 1 tokens
    → both caches keep each row's own tokens (`RaggedCache.keep_first`: the rejected columns become holes)
    → rows that stop (EOS, max_new_tokens, max_seq_len) leave the batch (`RaggedCache.select`).
Each row's draft count k_r ≤ w is capped by its own room, exactly as one row's; the target verifies the same
tokens a row-by-row round would, so at temperature 0 every row is the target's greedy output and under sampling
each row is distributed as the target's own samples (one shared `torch.Generator`, rows drawn in turn).

Per batch (D = Σ_r k_r drafted, A = Σ_r n_r accepted over the rows that drafted in a round):
    adaptive k: k += 1 when A == D, k −= 1 when A < 0.5·D, within [1, 2·spec_k] (one row: the row rule);
    fallback: after ≥ FALLBACK_MIN_ROUNDS batched rounds, if A/D over the last FALLBACK_WINDOW of them is below
    spec_disable_below_accept, the whole batch decodes target-only (every live row's fallback_round is set).
Forward counts are batched forwards; per-row drafted/accepted counts are in the stats (`row_acceptance`).
Does not know about manifests, timing or tokenizers; `SpeculativeGenerator` hands it the target model, the draft
side (`draft.Draft`), the round's rules (`rounds.RoundRules`: settings, filters, vocabulary, EOS, rng) and the stats.
"""

from __future__ import annotations

import torch

from runner.errors import InferenceError
from runner.infer.cache.ragged import RaggedCache, ragged_reason
from runner.infer.cache.registry import make_cache
from runner.infer.speculative.draft import Draft
from runner.infer.speculative.rounds import (
    RoundRules,
    SpeculativeStats,
    accept_exact,
    accept_reject,
    adapt_k,
    count_round,
    falls_back,
    filtered_probs,
    first_eos,
    pick,
)


def batched_reason(target: torch.nn.Module, draft: Draft, cache_kind: str | None) -> str:
    """Why caches of `cache_kind` for the target and the draft model cannot run rounds in a batch (then rows go one
    after another), or ""."""
    caches = [make_cache(cache_kind, target)]
    if draft.model is not None:
        caches.append(make_cache(cache_kind, draft.model))
    return next((reason for reason in map(ragged_reason, caches) if reason), "")


def left_padded(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """[B,T] ids and mask → each row's real tokens [T_r]; refuses right padding and empty rows."""
    if not bool(mask[:, -1].all()):
        raise InferenceError("batched speculative decoding takes left-padded prompts (a row ends in padding)")
    return [ids[r][mask[r].bool()] for r in range(ids.shape[0])]


def pad_rows(rows: list[torch.Tensor], width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged [n_r] token rows → ([b,width] tokens, [b,width] mask), padded with 0 on the left or the right."""
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        span = slice(width - row.numel(), width) if left else slice(0, row.numel())
        tokens[i, span], mask[i, span] = row, 1
    return tokens, mask


class BatchRun:
    """One `.generate()` call over a batch: live rows, their sequences and both ragged caches."""

    def __init__(self, target: torch.nn.Module, draft: Draft, rules: RoundRules, stats: SpeculativeStats,
                 ids: torch.Tensor, mask: torch.Tensor):
        self.model, self.source, self.rules, self.cfg, self.stats = target, draft, rules, rules.config, stats
        self.prompts = left_padded(ids, mask)  # each fits max_seq_len (SpeculativeGenerator.generate checked)
        self.seqs = list(self.prompts)  # [L_r] every token of each row so far (index = original row)
        self.live = list(range(ids.shape[0]))  # original row of each batch row
        self.outputs: list[torch.Tensor | None] = [None] * ids.shape[0]
        self.target = RaggedCache(make_cache(self.cfg.cache_kind, target))
        self.draft = None if draft.model is None else RaggedCache(make_cache(self.cfg.cache_kind, draft.model))
        self.rounds: list[tuple[int, int]] = []  # (D, A) of each batched round that drafted
        self._prefill(ids, mask)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Both caches take the prompts minus their last token [B,T-1] (that one enters with the first round)."""
        if ids.shape[1] < 2:
            return
        self.target.feed(self.model, ids[:, :-1], mask[:, :-1])
        self.stats.target_forwards += 1
        if self.draft is not None:
            self.draft.feed(self.source.model, self.source.tokens(ids[:, :-1]), mask[:, :-1])
            self.stats.draft_forwards += 1

    def run(self) -> list[torch.Tensor]:
        """Rounds until every row stops → each row's new tokens [N_r]."""
        k, target_only = self.cfg.spec_k, False
        while self.live:
            caps = [0 if target_only else self._cap(r, k) for r in self.live]
            drafted, accepted = self._round(caps)
            if drafted:
                self.rounds.append((drafted, accepted))
                if self.cfg.spec_k_adaptive:
                    k = adapt_k(k, drafted, accepted, 2 * self.cfg.spec_k)
                if not target_only and falls_back(self.rounds, self.cfg.spec_disable_below_accept):
                    target_only = True
                    for r in self.live:
                        self.stats.fallback_round[r] = len(self.rounds)
        outputs = [out for out in self.outputs if out is not None]
        assert len(outputs) == len(self.outputs), "every row stopped (_retire)"
        return outputs

    def _cap(self, r: int, k: int) -> int:
        """Most tokens row r may draft this round: k, within its room (as one row's round)."""
        produced = self.seqs[r].numel() - self.prompts[r].numel()
        room = min(self.cfg.max_new_tokens - produced, self.cfg.max_seq_len - self.seqs[r].numel())
        return min(k, room - 1 if self.cfg.spec_extra_token else room)

    def _round(self, caps: list[int]) -> tuple[int, int]:
        """Propose, verify all live rows in one forward, accept per row, keep, retire → (D, A) of the round."""
        drafts, q = self._propose(caps)  # [b,w] tokens, per row [k_r] real draft tokens, q [b,w,V] or None
        counts = [d.numel() for d in drafts]
        width = max(counts)
        pending = torch.stack([self.seqs[r][-1] for r in self.live])[:, None]  # [b,1]
        chunk = torch.cat([pending, pad_rows(drafts, width, left=False)[0]], dim=1)  # [b,w+1]
        logits = self.target.feed(self.model, chunk, torch.ones_like(chunk), keep=width + 1)  # [b,w+1,V]
        self.stats.target_forwards += 1
        self.stats.target_only_steps += width == 0
        results = [self._accept(r, drafts[i], None if q is None else q[i], logits[i, :counts[i] + 1])
                   for i, r in enumerate(self.live)]  # (new tokens [n_r+1] or [n_r], accepted n_r)
        kept = torch.tensor([new.numel() for new, _ in results], device=chunk.device)  # pending + n_r drafts
        self.target.keep_first(width + 1, kept)
        if self.draft is not None and width > 1:  # the draft fed x_1..x_{w-1} after its catch-up chunk
            self.draft.keep_first(width - 1, (kept - 1).clamp(max=width - 1))
        self._retire([new for new, _ in results])
        return sum(counts), sum(n for _, n in results)

    def _accept(self, r: int, draft: torch.Tensor, q, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Row r: its k_r draft tokens [k_r] against its logits [k_r+1,V] → (new tokens [n+1] (or [n]), n)."""
        rules, cfg = self.rules, self.cfg
        p = filtered_probs(logits, self.seqs[r], rules.sampling, rules.vocab)  # [k_r+1,V]
        if draft.numel() == 0:
            return torch.tensor([pick(p[0], cfg.greedy, rules.rng)], device=draft.device), 0
        if cfg.greedy or cfg.spec_method == "greedy":
            n, token = accept_exact(draft, p, cfg.greedy, rules.rng)
        else:
            n, token = accept_reject(draft, q[:draft.numel()], p, rules.rng)
        if token < 0 and cfg.spec_extra_token:
            token = pick(p[n], cfg.greedy, rules.rng)
        count_round(self.stats, r, draft.numel(), n)
        tail = torch.tensor([token] if token >= 0 else [], dtype=torch.long, device=draft.device)
        return torch.cat([draft[:n], tail]), n

    def _propose(self, caps: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per row ≤ caps[r] draft tokens ([k_r] each) and, for a model draft, q [b,w,V] (None for lookup)."""
        width = max(caps)
        if width <= 0:
            return [self.seqs[r][:0] for r in self.live], None
        if self.draft is None:  # prompt lookup, or a draft with another tokenizer: a proposal per row
            drafts = [self.source.propose(r, self.seqs[r], cap) for r, cap in zip(self.live, caps)]
            q = torch.zeros(len(drafts), max(d.numel() for d in drafts), self.rules.vocab, device=drafts[0].device)
            for i, d in enumerate(drafts):
                q[i, torch.arange(d.numel()), d] = 1.0
            return drafts, q
        tokens, probs = self._draft_tokens(width)  # [b,w], [b,w,V]
        return [tokens[i, :cap] for i, cap in enumerate(caps)], probs

    def _draft_tokens(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft catches up on the tokens it has not seen, then drafts `width` tokens per row: [b,w], [b,w,V]."""
        source, rules, draft = self.source, self.rules, self.draft
        assert draft is not None  # _propose drafts through this only for a draft model
        seen = draft.seen.tolist() if draft.seen is not None else [0] * len(self.live)
        behind = [self.seqs[r][int(n):] for r, n in zip(self.live, seen)]
        tokens, mask = pad_rows(behind, max(b.numel() for b in behind), left=True)  # [b,≤2], holes on the left
        logits = draft.feed(source.model, source.tokens(tokens), mask)[:, -1]  # [b,V']
        drafted, probs = [], []
        for i in range(width):
            self.stats.draft_forwards += 1
            q = torch.cat([filtered_probs(logits[j:j + 1], self.seqs[r], rules.sampling, rules.vocab)
                           for j, r in enumerate(self.live)])  # [b,V]
            drafted.append(torch.tensor([pick(q[j], self.cfg.greedy, rules.rng) for j in range(q.shape[0])],
                                        device=q.device))
            probs.append(q)
            if i + 1 < width:
                token = drafted[-1][:, None]  # [b,1]
                logits = draft.feed(source.model, source.tokens(token), torch.ones_like(token))[:, -1]
        return torch.stack(drafted, dim=1), torch.stack(probs, dim=1)

    def _retire(self, news: list[torch.Tensor]) -> None:
        """Append each row's new tokens; rows that stop leave the batch (and both caches)."""
        stay = []
        for i, (r, new) in enumerate(zip(self.live, news)):
            self.seqs[r] = torch.cat([self.seqs[r], new])
            reason = self.rules.stop_reason(self.seqs[r], self.prompts[r].numel())
            if not reason:
                stay.append(i)
                continue
            out = self.seqs[r][self.prompts[r].numel():]
            out = out[:first_eos(out, self.rules.eos_ids) + 1] if reason == "eos" else out[:self.cfg.max_new_tokens]
            self.outputs[r] = out
            self.stats.new_tokens[r], self.stats.stop_reasons[r] = out.numel(), reason
        if len(stay) < len(self.live):
            self.live = [self.live[i] for i in stay]
            if stay:
                assert self.target.mask is not None  # the round's verify forward fed it
                rows = torch.tensor(stay, device=self.target.mask.device)
                self.target.select(rows)
                if self.draft is not None and self.draft.mask is not None:
                    self.draft.select(rows)


def generate_batched(target: torch.nn.Module, draft: Draft, rules: RoundRules, stats: SpeculativeStats,
                     ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """[B,T] left-padded prompts → each row's new tokens [N_r], the rounds batched (see the module docstring)."""
    return BatchRun(target, draft, rules, stats, ids, mask).run()
