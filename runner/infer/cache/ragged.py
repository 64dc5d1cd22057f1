"""A batched cache whose rows hold different numbers of real tokens: ragged rows kept with holes, not realigned.

Owns `RaggedCache` (a transformers cache + the mask of its columns + the real tokens of each row) and
`ragged_reason`, which says why a cache cannot be ragged. Speculative rounds append the same number of columns
to every row, then each row keeps its own number of them: the others become holes (mask 0). A hole is a column
whose key/value stay in the cache but that no later query attends to; positions come from `positions_from`,
which counts real tokens only, so a row's positions are exactly those of a row that never had the hole.
Columns that are holes in every row are cropped.

Why this is exact per cache kind (exact arithmetic; see `ragged_reason` for the kinds it refuses):
    fp32 / fp16 / bf16, q8_0 / q4_0 / q4_1 / nf4: every token's stored K/V is a function of that token alone
    (a cast, or blocks along head_dim), so a row's real tokens are stored exactly as in a cache without holes;
    a masked column gets a softmax weight of exactly 0 (its K/V are finite: computed from real tokens).
    KIVI: keys are quantized per channel over groups of g consecutive columns and the residual flushes by
    column count, so a hole would enter the scale and minimum of its row's group: refused.
    Sliding-window and other layers that evict by column count: a hole would use up window: refused.
In floating point, holes (like left padding) change where the exact zeros sit in the attention reductions, so
logits can differ from a hole-free layout in the last bits; greedy tokens differ only at near ties.
Does not know about drafts, sampling or timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from runner.infer.cache.layers import CastLayer, KiviLayer, QuantLayer
from runner.infer.decode.forward import positions_from


def ragged_reason(cache) -> str:
    """Why `cache` cannot hold ragged rows with holes, or "" when it can (layers that store each token alone)."""
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, KiviLayer):
            return ("KIVI quantizes keys per channel over groups of consecutive columns, so a hole would enter a "
                    "row's group statistics")
        if not (type(layer) is DynamicLayer or isinstance(layer, (CastLayer, QuantLayer))):
            return f"its {type(layer).__name__} layers may evict or group columns (a hole would change them)"
    return ""


@dataclass
class RaggedCache:
    """A cache of [B] rows and what its columns hold. Change it only through its methods."""

    cache: Cache  # a transformers Cache of per-token layers (ragged_reason(cache) == "")
    mask: torch.Tensor | None = None  # [B,C] 1 = a real token of the row, 0 = left padding or a hole
    seen: torch.Tensor | None = None  # [B] real tokens held: the position of each row's next token

    @property
    def columns(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def feed(self, model, tokens: torch.Tensor, new_mask: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Append [B,t] tokens (new_mask [B,t]: 0 = a hole) → float32 logits of the last `keep` columns [B,keep,V]."""
        positions = positions_from(self.seen, new_mask)  # [B,t]
        mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)  # [B,C+t]
        out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                    use_cache=True, logits_to_keep=keep)
        self.mask = mask
        self.seen = new_mask.sum(-1) if self.seen is None else self.seen + new_mask.sum(-1)
        return out.logits.float()

    def keep_first(self, columns: int, counts: torch.Tensor) -> None:
        """Of the last `columns` columns, row r keeps its first counts[r] real tokens; the rest become holes."""
        if columns <= 0:
            return
        assert self.mask is not None and self.seen is not None, "keep_first follows a feed"
        tail = self.mask[:, -columns:]  # [B,t]
        kept = tail * (tail.cumsum(-1) <= counts[:, None])  # [B,t]
        self.seen = self.seen - tail.sum(-1) + kept.sum(-1)
        self.mask = torch.cat([self.mask[:, :-columns], kept], dim=1)
        self._crop_holes()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` [b] (indices), in that order."""
        assert self.mask is not None and self.seen is not None, "select follows a feed"
        self.cache.batch_select_indices(rows)
        self.mask, self.seen = self.mask[rows], self.seen[rows]
        self._crop_holes()

    def _crop_holes(self) -> None:
        """Crop the trailing columns that are holes in every row."""
        assert self.mask is not None, "only after a feed"
        used = self.mask.any(0).nonzero()  # [n,1] columns real in some row
        drop = self.columns - (int(used[-1]) + 1 if used.numel() else 0)
        if drop > 0:
            self.cache.crop(-drop)
            self.mask = self.mask[:, :-drop]
