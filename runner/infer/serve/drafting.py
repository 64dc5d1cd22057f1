"""Draft-model speculation under continuous batching: a small model that shares the target's tokenizer proposes
tokens for every greedy decoding row of a step, in batched forwards of its own, before the target's one verify.

Each running request gets a draft cache of its own (the draft model's dtype, a DynamicCache), fed lazily: when a
row is asked for a proposal, its draft cache first takes every token of the row's sequence it does not hold (the
whole prompt after admission or preemption, else the one or two tokens the last verify emitted), then one token per
further proposed token. Rows of a step advance together (serve/rows.feed_rows: each row left-padded to the longest
chunk; a whole prompt goes in a forward of its own first), so a step costs k draft forwards whatever the batch.
Between steps a draft cache holds its row's sequence up to the last proposal and the k − 1 guesses it fed; what the
verify rejected is cropped before it is fed again.
What it does not do: the draft caches are outside the KV budget (blocks count the target's K/V only: say so when
reading admission); a draft with another tokenizer (text drafts) is not served; the draft's prompt is prefilled
whole in the first step the row decodes, outside the step's token budget.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

from runner.infer.cache.registry import make_cache
from runner.infer.decode.sampling import greedy_tokens
from runner.infer.serve.rows import feed_rows, rows_reason


class DraftRows:
    """A draft model's caches, one per request id, and the tokens each holds."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        if reason := rows_reason(make_cache(None, self.model)):
            raise ValueError(f"the draft model cannot be scheduled: {reason}")
        rows = self.model.get_input_embeddings().weight
        self.vocab = rows.shape[0]  # ids it cannot embed are fed as 0 (exactness holds, acceptance drops)
        self.caches: dict[int, Cache] = {}
        self.fed: dict[int, list[int]] = {}  # the tokens each draft cache holds
        self.checked: dict[int, int] = {}  # fed[:checked] is known to be the row's sequence
        self.forwards = 0

    def propose(self, rows: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """(request id, its sequence, k) per row → k greedy draft tokens per row (none where k is 0)."""
        drafts: list[list[int]] = [[] for _ in rows]
        active = [r for r, (_, _, k) in enumerate(rows) if k > 0]
        chunks = {r: self._catch_up(*rows[r][:2]) for r in active}
        for r in active:  # a whole prompt (after admission or preemption) alone, not the batch padded to it
            if len(chunks[r]) > 2:
                self._feed([rows[r][0]], [chunks[r][:-1]])
                chunks[r] = chunks[r][-1:]
        while active:
            logits = self._feed([rows[r][0] for r in active], [chunks[r] for r in active])  # [B,1,V]
            for r, token in zip(active, greedy_tokens(logits[:, -1]).tolist()):
                drafts[r].append(token)
                chunks[r] = [token]
            active = [r for r in active if len(drafts[r]) < rows[r][2]]
        for r, (rid, sequence, _) in enumerate(rows):  # what is past the sequence is a guess until verified
            if drafts[r]:
                self.checked[rid] = len(sequence)
        return drafts

    def _feed(self, ids: list[int], chunks: list[list[int]]):
        """One forward of the draft: row `ids[r]` fed `chunks[r]` → [B,1,V] logits of each row's last token."""
        logits = feed_rows(self.model, [[t if t < self.vocab else 0 for t in chunk] for chunk in chunks],
                           [self.caches[i] for i in ids], [len(self.fed[i]) for i in ids])
        for i, chunk in zip(ids, chunks):
            self.fed[i] += chunk
        self.forwards += 1
        return logits

    def _catch_up(self, rid: int, sequence: list[int]) -> list[int]:
        """Crop row `rid`'s draft cache to what it shares with `sequence` (never all of it: the last token is fed
        again, its logits propose) → the tokens it must be fed."""
        if rid not in self.caches:
            self.caches[rid], self.fed[rid], self.checked[rid] = make_cache(None, self.model), [], 0
        fed = self.fed[rid]
        keep = min(len(fed), len(sequence) - 1)
        keep = next((i for i in range(self.checked[rid], keep) if fed[i] != sequence[i]), keep)
        if keep < len(fed):
            self.caches[rid].crop(keep - len(fed))  # a negative count: the last ones go
            del fed[keep:]
        self.checked[rid] = keep
        return sequence[keep:]

    def drop(self, rid: int) -> None:
        """The request left the running batch (finished, cancelled or preempted): its draft cache goes."""
        self.caches.pop(rid, None)
        self.fed.pop(rid, None)
        self.checked.pop(rid, None)

