"""One batched forward over requests that each own their cache: the decode step of continuous batching.

Each running request has a cache of its own (its blocks in the pool, serve/paged.py, or for KIVI its own
`registry.make_cache`, batch 1), so what it stores is exactly what a solo decode stores, for every kind, KIVI's
per-request groups and residual included. A decode step builds a transformers Cache of `RowsLayer`s over the rows of
the step: each layer's `update` splits the new [B,H,1,D] K/V by row, hands row r's to row r's own layer (rows in the
pool: one write and one gather for all, their columns computed once a step, paged.step_columns), and returns every
row's whole K/V stacked right-aligned ([B,H,W,D], W the longest row; zeros on the left, masked by the 2D padding
mask). Positions are explicit per row (`positions_from` semantics: the real tokens before), so a row's attention and
RoPE are those of a solo decode; only float reductions over the masked columns can move the logits in the last bits
(greedy differs only at near ties).

Prefill chunks of several requests go in one forward the same way (`feed_rows`: each row left-padded to the
longest chunk; the padding is sliced off before it reaches a row's layer, so it is never stored). `chunk_end`
says where a chunk may end so that the cache ends up as a whole-prompt prefill then one-token decodes would leave
it: any end for kinds that store each token alone; for KIVI, ends aligned to its residual flushes (below).
Costs: stacking copies every row's K/V once per layer per step (O(B·W) on top of each row's own gather or
concatenation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from runner.infer.cache.layers import CastLayer, KiviLayer, QuantLayer
from runner.infer.decode.forward import forward_tail
from runner.infer.serve.paged import PagedLayer, step_columns, update_rows


def rows_reason(cache: Cache) -> str:
    """Why a request's own cache cannot be a row of a RowsCache, or "" when it can."""
    for layer in cache.layers:
        if not (type(layer) is DynamicLayer or isinstance(layer, (CastLayer, QuantLayer, KiviLayer))):
            return (f"its {type(layer).__name__} layers keep or evict columns by their own rule (a sliding window?): "
                    "the scheduler's rows are full-attention layers")
    return ""


class RowsLayer(DynamicLayer):
    """One model layer of a step: row r's new K/V (its last `news[r]` columns; the rest is left padding, never
    stored) go into `rows[r]`, that request's own layer."""

    def __init__(self, rows: list, past: int, news: list[int], columns: tuple[torch.Tensor, torch.Tensor] | None):
        super().__init__()
        self.rows, self.past, self.news = rows, past, news  # past: the mask's offset (width − new columns)
        self.columns = columns  # rows in the pool: the step's paged.step_columns, shared by every layer; else None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """[B,H,T,D] new K/V → every row's whole K/V right-aligned, [B,H,past+T,D] each (zeros on the left)."""
        t = key_states.shape[-2]
        if self.columns is not None:  # rows in the pool: one write and one gather for the batch
            return update_rows(self.rows, key_states, value_states, self.news, self.columns)
        held = [row.update(key_states[r:r + 1, :, t - n:], value_states[r:r + 1, :, t - n:])
                for r, (row, n) in enumerate(zip(self.rows, self.news))]
        width = self.past + t
        keys = key_states.new_zeros((*key_states.shape[:2], width, held[0][0].shape[-1]))
        values = value_states.new_zeros((*value_states.shape[:2], width, held[0][1].shape[-1]))
        for r, (k, v) in enumerate(held):  # k, v: [1,H,L_r,D]
            keys[r, :, width - k.shape[-2]:] = k[0]
            values[r, :, width - v.shape[-2]:] = v[0]
        return keys, values

    def get_seq_length(self) -> int:
        return self.past


def feed_rows(model, chunks: list[list[int]], caches: list[Cache], lengths: list[int], keep: int = 1) -> torch.Tensor:
    """One forward of B requests, each feeding its own chunk of tokens (decode: one each, or one and its draft)
    into its own cache that holds lengths[r] tokens → [B,keep,V] logits of the last `keep` columns (row r's last
    min(keep, len(chunk r)) are its own). Rows are left-padded to the longest chunk T; the padding is neither
    stored nor attended to."""
    device = next(model.parameters()).device
    t = max(len(c) for c in chunks)
    news = [len(c) for c in chunks]
    width = max(held + n for held, n in zip(lengths, news))  # the longest row after this step
    ids = torch.zeros((len(chunks), t), dtype=torch.long)  # [B,T]
    positions = torch.zeros_like(ids)  # [B,T]: pads at 0, never stored
    mask = torch.zeros((len(chunks), width), dtype=torch.long)  # [B,W]: each row's last held + n columns
    for r, (chunk, held) in enumerate(zip(chunks, lengths)):
        ids[r, t - len(chunk):] = torch.tensor(chunk)
        positions[r, t - len(chunk):] = torch.arange(held, held + len(chunk))
        mask[r, width - held - len(chunk):] = 1
    n_layers = len(caches[0].layers)
    paged = [c.layers[0] for c in caches if isinstance(c.layers[0], PagedLayer)]
    columns = step_columns(paged, news, width) if len(paged) == len(caches) else None  # once for every layer
    batch = Cache(layers=[RowsLayer([c.layers[i] for c in caches], width - t, news, columns)
                          for i in range(n_layers)])
    return forward_tail(model, ids.to(device), mask.to(device), positions.to(device), batch, keep)


@dataclass(frozen=True)
class Flushes:
    """Where a kind quantizes by column count (KIVI): `sinks` tokens kept apart, then a flush every `every` tokens."""

    sinks: int = 0
    every: int = 1  # 1: the kind stores each token alone (every chunk end is exact)

    @classmethod
    def of(cls, cache: Cache) -> Flushes:
        layer = cache.layers[0] if cache.layers else None
        if isinstance(layer, KiviLayer):
            return cls(layer.sinks, layer.residual_len)
        return cls()

    def completes(self, tokens: int) -> bool:
        """Whether the update that brings a layer to `tokens` tokens quantizes its residual."""
        return tokens > self.sinks and (tokens - self.sinks) % self.every == 0

    def exact(self, start: int, end: int, prompt: int) -> bool:
        """Whether feeding tokens [start, end) as one chunk leaves the cache (and every token's attention) as a
        solo decode does: the prompt [0, prompt) prefilled whole, then one token at a time.

        KIVI hands attention the dequantized K/V of the groups an update flushes, the residual in full precision. A
        whole prefill flushes every full group of the prompt at once, so a prompt chunk must end at a flush, at the
        sinks, or at the prompt's end. A decoded token sees its own group dequantized only if it completes it, so a
        chunk past the prompt may contain a completing token only as its first."""
        if self.every == 1 or end <= self.sinks:
            return True
        if start < prompt < end:
            return False
        if end <= prompt:
            return end == prompt or self.completes(end)
        return not any(self.completes(p + 1) for p in range(start + 1, end))


def chunk_end(start: int, limit: int, target: int, prompt: int, flushes: Flushes) -> tuple[int, bool]:
    """Where a chunk from `start` ends: the furthest exact end ≤ min(limit, target) → (end, True); if none, the
    nearest exact end above it → (end, False) (over the budget)."""
    top = min(limit, target)
    for end in range(top, start, -1):  # kinds that store each token alone: the first one
        if flushes.exact(start, end, prompt):
            return end, True
    end = max(top, start) + 1
    while end < target and not flushes.exact(start, end, prompt):
        end += 1
    return min(end, target), False
