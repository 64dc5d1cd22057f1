"""The one-token step the compiled engine compiles and the state the Generator drives over a static cache.

    decode_step: [B,T] ids, [B,T] positions, [T] columns, 0-d end of the real ones, [B,S] mask → [B,T,V] logits,
    every shape fixed by the cache (compiled.CompiledEngine compiles it once per shape).
    StaticDecodeState: a decode.forward.DecodeStateProtocol (prefill, feed; cache, mask, seen, length) over b real
    rows of a B-row static cache, so the Generator's loop, its sampling, stop rules and beam reordering work on it
    unchanged; speculative decoding uses `feed_row` / `get_seq_length` / `crop` on a batch-1 state.
Rows past b are dummies that attend only to themselves; their logits are dropped.
Owns: static masks, the step function, the writes a step makes (`set_writes`), prefill pieces, the state. Does not
compile anything: it calls the engine it was made by for the steps it compiled.
"""

from __future__ import annotations

import torch

from runner.errors import InferenceError
from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.static.cache import StaticKVCache
from runner.infer.compiled.attention import STATIC_CACHE, reduced_attention
from runner.infer.config.eviction import speculative_eviction_reason
from runner.infer.decode.forward import positions_from

PREFILL_MIN, PREFILL_MAX = 16, 512  # compiled prefill pieces: powers of two between these (prefill_pieces)


def static_mask(mask2d: torch.Tensor, columns: torch.Tensor, eager_attention: bool, dtype: torch.dtype) -> torch.Tensor:
    """[B,S] real columns (1 = a real token written there) and the [T] columns being fed → [B,1,T,S] attention
    mask: a query sees the real columns up to its own, and always itself (a pad or dummy query then attends to
    something, so no row of softmax is empty). Boolean for sdpa, additive for eager attention."""
    span = torch.arange(mask2d.shape[1], device=mask2d.device)  # [S]
    causal = span[None, :] <= columns[:, None]  # [T,S]
    allowed = (mask2d[:, None, None, :].bool() & causal[None, None]) | (span[None, :] == columns[:, None])[None, None]
    if not eager_attention:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=mask2d.device).masked_fill(~allowed, torch.finfo(dtype).min)


def decode_step(model, cache: StaticKVCache, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
                end: torch.Tensor, mask2d: torch.Tensor, weights: dict | None = None, keep: int = 0) -> torch.Tensor:
    """[B,T] ids at [B,T] positions into `columns` [T] of the cache (those from `end`, 0-d, on are padding),
    [B,S] real columns → [B,T,V] logits (of the last `keep` columns when keep > 0: an eager prefill needs only its
    last, and the head is a fifth of a small model's work), with the model's own parameters or `weights` in their
    place. The function the engine compiles (one graph per shape); other lengths run it eagerly."""
    cache.columns, cache.end = columns, end
    eager = model.config._attn_implementation == "eager"
    attention = static_mask(mask2d, columns, eager, model.dtype)
    inputs = dict(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache,
                  use_cache=True, logits_to_keep=keep or ids.shape[1], **{STATIC_CACHE: cache})
    out = model(**inputs) if weights is None else torch.func.functional_call(model, weights, (), inputs)
    return out.logits


def set_writes(cache: StaticKVCache, model, new: int, coding: bool) -> None:
    """Set what the cache's writes do in a step of `new` columns: code KIVI blocks and sinks (`coding`: callers
    pass True for every step of several columns), and hand attention K/V views only where the kernel does not read
    every layer."""
    cache.code_blocks(coding, views=not (new == 1 and cache.kernel_attends(model.dtype)))


def prefill_pieces(columns: int) -> list[tuple[int, int]]:
    """A prompt of `columns` → (real, padded) columns of each compiled prefill piece: whole pieces of PREFILL_MAX,
    then the rest padded on the right to a power of two ≥ PREFILL_MIN (a few shapes serve every prompt)."""
    pieces = [(PREFILL_MAX, PREFILL_MAX)] * (columns // PREFILL_MAX)
    rest, padded = columns % PREFILL_MAX, PREFILL_MIN
    while padded < rest:
        padded *= 2
    return pieces + ([(rest, padded)] if rest else [])


def _right_pad(t: torch.Tensor, extra: int) -> torch.Tensor:
    """[b,T] → [b,T+extra], zeros after (pad id 0, position 0, mask 0: the padding is never attended to)."""
    return t if extra == 0 else torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1)


class StaticDecodeState:
    """A decode state (decode.forward.DecodeStateProtocol) over a static cache: b real rows of a B-row cache,
    `length` columns written so far. `engine`: the compiled.CompiledEngine that made it, whose `call` runs its
    compiled steps; `key` (kind, rows, columns): the shape those steps were compiled for."""

    def __init__(self, engine, key: tuple, cache: StaticKVCache, batch: int,
                 step_lengths: tuple[int, ...], compiled_prefill: bool = False):
        self.engine, self.key, self.cache, self.rows, self.step_lengths = engine, key, cache, batch, step_lengths
        self.compiled_prefill = compiled_prefill  # prompts in compiled pieces (prefill_pieces), not eagerly
        self.columns = torch.zeros(cache.batch, cache.length, dtype=torch.long, device=engine.device)  # [B,S]
        self.seen: torch.Tensor | None = None  # [b] real tokens so far: the next position
        self.column = 0  # the next column written (< length once eviction compacted a prompt forward)
        self.length = 0  # columns (tokens and pads) fed so far, as the eager state counts them (max_seq_len)

    @property
    def mask(self) -> torch.Tensor:
        """[b,column] mask of what the cache holds (DecodeStateProtocol's)."""
        return self.columns[:self.rows, :self.column]

    def _pad(self, t: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[b,...] → [B,...], dummy rows filled with `fill`."""
        extra = self.cache.batch - self.rows
        return t if extra == 0 else torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])

    def _forward(self, model, ids: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
                 compiled: bool = True, real: int | None = None, keep: int = 0) -> torch.Tensor:
        """[b,T] ids, positions and mask into the next T columns → [b,T,V] logits (`keep` > 0: of the last `keep`
        columns when run eagerly); compiled when T is a step length, else the same static forward run eagerly. Only
        the first `real` columns (default all) count: the rest are padding, masked, and the next write goes over
        them."""
        t = ids.shape[1]
        real = t if real is None else real
        if self.column + t > self.cache.length:
            raise InferenceError(f"the compiled engine's cache holds {self.cache.length} columns; this call needs "
                                 f"{self.column + t}: raise max_seq_len or start a new conversation")
        columns = torch.arange(self.column, self.column + t, device=ids.device)  # [T]
        self.columns[:, self.column:self.column + t] = self._pad(new_mask)
        ids, positions = self._pad(ids).contiguous(), self._pad(positions).contiguous()  # a beam's tokens are a view
        args = (self.cache, ids, positions, columns, columns[real - 1] + 1)
        if compiled and t in self.step_lengths:
            logits = self.engine.call(self.key, *args, self.columns,
                                      coding=t == 1 and self.cache.needs_coding(self.column, real))
        else:  # an eager forward of several columns attends to the columns written so far, not the whole cache
            written = self.columns[:, :self.column + t] if t > 1 and self.cache.eviction is None else self.columns
            set_writes(self.cache, model, t, True)
            with reduced_attention(model):
                logits = decode_step(model, *args, written,
                                     self.engine.weights if model is self.engine.model else None, keep=keep)
        self.column += real
        self.length += real
        return logits[:self.rows]

    def prefill(self, model, ids: torch.Tensor, new_mask: torch.Tensor, q_chunk: int | None = None,
                hidden: bool = False) -> tuple[torch.Tensor, None]:
        """[b,T] ids and mask → (last logits [b,V], None). In `prefill_pieces` when their padded lengths were
        compiled (prefill: compiled), each piece one compiled step; else eager static forwards, q_chunk columns at
        a time."""
        if hidden:
            raise InferenceError("engine 'compiled' does not return hidden states (contrastive search): use eager")
        positions = positions_from(self.seen, new_mask)  # [b,T]
        self.seen = new_mask.sum(-1) if self.seen is None else self.seen + new_mask.sum(-1)
        if self.compiled_prefill and not q_chunk:
            start = 0
            for real, padded in prefill_pieces(ids.shape[1]):
                part = slice(start, start + real)
                extra = padded - real if padded in self.step_lengths else 0  # not compiled up front: eager, unpadded
                logits = self._forward(model, _right_pad(ids[:, part], extra), _right_pad(positions[:, part], extra),
                                       _right_pad(new_mask[:, part], extra), real=real)
                start += real
            return logits[:, real - 1], None
        step = q_chunk or ids.shape[1]
        for start in range(0, ids.shape[1], step):
            part = slice(start, start + step)
            if self.cache.eviction is not None and ids[:, part].shape[1] > 1:
                logits = self._evicting_forward(model, ids[:, part], positions[:, part], new_mask[:, part])
            else:
                logits = self._forward(model, ids[:, part], positions[:, part], new_mask[:, part], compiled=False,
                                       keep=1)
        return logits[:, -1], None

    def _evicting_forward(self, model, ids: torch.Tensor, positions: torch.Tensor,
                          new_mask: torch.Tensor) -> torch.Tensor:
        """A prompt forward of a kind with eviction ([b,t] ids, positions, mask → [b,t,V] logits), the eager
        engine's EvictingMixin on a static cache: one static forward, run eagerly, writes all t columns from
        `column` while each layer chooses its kept columns per (row, KV head) from the exact K/V (StaticKVCache's
        `score_next`); the cache then moves them to the forward's first k columns (`compact`), the mask follows
        (a row's pads first), and the next write goes to column start + k. Positions stay the real tokens' (`seen`)."""
        start, t = self.column, ids.shape[1]
        self.cache.score_next(self._pad(new_mask).bool())
        try:
            logits = self._forward(model, ids, positions, new_mask, compiled=False)
        except BaseException:
            self.cache.stop_scoring()
            raise
        kept = self.cache.compact(start)
        if kept is not None:
            k = kept.shape[1]
            self.columns[:, start:start + k] = kept
            self.columns[:, start + k:start + t] = 0
            self.column = start + k
        return logits

    def feed(self, model, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """One compiled decode step: [b] token (live [b] 0/1: a finished row feeds a masked pad) → [b,V] logits."""
        assert self.seen is not None, "feed after prefill"
        positions = self.seen[:, None]  # [b,1]
        self.seen = self.seen + live
        return self._forward(model, token[:, None], positions, live[:, None])[:, -1]

    def held_bytes(self) -> int:
        """Bytes of the tokens the cache holds, as an eager cache measures them (and estimate_cache_bytes says): the
        real rows' columns written so far of a plain or block layout (one token's codes per column; a kind with
        eviction: its kept tokens and those fed since). A KIVI layout (sinks, blocks, ring) has no bytes per column:
        its whole buffer. The preallocated buffer itself (cache_bytes of the cache) never shrinks."""
        if self.cache.codes_columns():
            return cache_bytes(self.cache)
        return sum(layer.held_bytes(self.rows, self.column) for layer in self.cache.static_layers)

    # speculative rounds: one row, no padding, the cache rolled back after a rejection

    def get_seq_length(self) -> int:
        return self.column

    def feed_row(self, model, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Batch 1: [t] tokens appended → [keep,V] float32 logits of the last `keep` of them."""
        if self.cache.eviction is not None:  # config.eviction.speculative_eviction_reason: refused before this
            raise InferenceError(speculative_eviction_reason(f"{self.cache.kind}+{self.cache.eviction.canonical}"))
        positions = torch.arange(self.column, self.column + tokens.shape[0], device=tokens.device)[None]
        logits = self._forward(model, tokens[None], positions, torch.ones_like(tokens)[None], keep=keep)
        return logits[0, -keep:].float()  # a compiled step returns every column's

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove columns (a negative count, as transformers' crop): their mask goes to
        0 and the next write overwrites them (KIVI: kept columns leave the quantized region, `rollback`)."""
        held = self.column
        self.column += tokens_to_remove
        self.length += tokens_to_remove
        self.columns[:, self.column:] = 0
        self.cache.rollback(self.column, held)

    @property
    def layers(self) -> list:
        """The cache's layers (what speculative.tokens_before_flush reads their residual length from)."""
        return self.cache.layers
