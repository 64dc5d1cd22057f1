"""Continuous batching on the compiled engine: requests join and leave the rows ("slots") of one static cache.
docs/serve.md ("Our scheduler on the compiled engine", its prefix and KIVI paragraphs) says it whole; in short:

The cache has B = batch_bucket(max_running) rows and S = `columns` columns. All rows decode at one shared column
pointer c through the one compiled step (kind, B, S, 1 new column), each row with its own positions and [S] mask, so
its attention and RoPE are a solo decode's; a running request holds columns [c − held, c) of its row.
    join     prompts admitted together are prefilled through a static cache of the kind (up to PREFILL_ROWS a
             forward, left-padded) and their K/V copied into their rows ending at c.
    mixed    where the native step serves the cache (compiled.native_step: llama/qwen2, float weights and K/V), a
             step's decode rows and the prompts it places run in one forward instead: each prompt written straight
             into its row at columns [c + 1 − m, c + 1), its last token the row's token, the others extra rows of
             the same products, attending causally within the row. No prefill cache, no copy.
    rebase   when c reaches S, a joining prompt is longer than c, or c ≥ 2·W + SLACK (W the longest row; on CPU
             attention reads [0, c]): the held columns move in place so that all rows end at W (or at the prompt).
    KIVI     blocks of r columns are coded when c completes them: a request joins when its length ≡ c (mod r),
             staged in a one-row cache until then; a recomputed one feeds its outputs again one a step.
    prefix   with `prefix_caching`, a prompt's leading blocks held by a placed row or a retained prompt (`kept`) are
             copied in and only the rest fed; each row keeps its own copy (the cache is allocated whole anyway).
The load runs one compiled shape, compiled in warm-up (`CompiledSlots.__init__`): `recompiles` counts graphs made
after it (0 expected), `compile_s` is the warm-up's compile time.

The scheduler's rules are serve/scheduler.Scheduler's (a subclass): blocks, admission, preemption by recompute,
finish rules and sampling. Greedy output equals each request's solo greedy decode up to float reductions over masked
columns. Not done: KIVI with sinks (`compiled_serve_reason`), chunked prefill (a prompt is placed whole), compiled
prefill, prefix caching of KIVI kinds, requests longer than S (refused), several length buckets.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.static.cache import StaticKVCache, make_static_cache
from runner.infer.compiled.engine import CompiledEngine, engine_for
from runner.infer.compiled.native_step import Extra
from runner.infer.compiled.state import StaticDecodeState
from runner.infer.config.kinds import compiled_serve_reason
from runner.infer.serve.live import Clock, Live, SchedulerConfig
from runner.infer.serve.prefix import Retained
from runner.infer.serve.requests import Request, RequestRecord
from runner.infer.serve.scheduler import Scheduler, rows_of

log = logging.getLogger(__name__)

SLOT = "serve"  # the engine cache slot the server's static cache lives in (apart from a Generator's)
SLACK = 64  # columns of holes past twice the longest row that trigger a rebase before the cache is full
PREFILL_ROWS = 8  # most prompts prefilled in one forward; each power of two up to it has its own static cache


class Cached(NamedTuple):
    """Where a prompt's cached prefix is held now: `tokens` of it in columns [first, first + tokens) of `source`'s
    `row` (a placed row of the slots' cache, or a retained copy's row 0); tokens 0: none."""

    source: StaticKVCache
    row: int
    first: int
    tokens: int


class CompiledSlots(Scheduler):
    """The continuous-batching scheduler over the compiled engine's one static cache (module docstring). `columns`:
    S, the most tokens (prompt + new) one request may hold; `engine`: the model's compiled engine by default."""

    def __init__(self, model, config: SchedulerConfig | None = None, clock: Clock | None = None, tokenizer=None,
                 columns: int = 512, engine: CompiledEngine | None = None, mixed: bool = True):
        config = config or SchedulerConfig()
        if reason := compiled_serve_reason(config.cache_kind):
            raise ValueError(f"cache kind {config.cache_kind!r} cannot be served on the compiled engine: {reason}")
        if config.spec_k:
            raise ValueError("speculation (spec_k) runs on the eager engine's scheduler only; the compiled slots "
                             "decode one token a step")
        super().__init__(model, config, clock, tokenizer)
        self.store = None  # its rows live in one static cache
        self.kept: dict[int, StaticKVCache] = {}  # a retained prefix's key → its tokens, columns [0, held) of a row
        self.engine = engine or engine_for(model)
        before = self.engine.stats.reading()
        state = self.engine.state(config.cache_kind, config.max_running, columns, columns,
                                  slot=SLOT)  # compiles the one step (kind, B, S, 1) now
        after = self.engine.stats.reading()
        self.compile_s, self.compiles = after[0] - before[0], after[1] - before[1]
        self._recompiles_at = after[2]
        self.key, self.cache = state.key, state.cache  # key: (kind, B, S)
        self.slots, self.columns = self.cache.batch, self.cache.length
        self.prefill_caches: dict[int, StaticKVCache] = {}  # rows → a static cache prompts are prefilled into
        with torch.inference_mode():  # an inference tensor, as the step was compiled for (else guards fail)
            self.mask = torch.zeros(self.slots, self.columns, dtype=torch.long, device=self.device)  # [B,S]
        self.pointer = 0  # c: the column every row writes next
        self.slot_of: dict[int, int] = {}  # request id → its row
        self.placed: set[int] = set()  # request ids whose K/V are in their row
        self.rebases = 0
        self.every = self.flushes.every  # KIVI: r, and every row starts at a multiple of it (module docstring)
        self.staged: dict[int, tuple[Live, StaticKVCache]] = {}  # KIVI: request id → (it, a one-row cache), `_stage`
        self.spare: list[StaticKVCache] = []  # one-row caches free for staging
        self.stagings = 0  # requests that waited staged for their block boundary
        native = self.engine.native
        self.native = native if mixed and native is not None and native.mixes(self.cache) else None  # mixing
        self.shared_forwards = 0  # mixed forwards that carried decode rows and prompts both
        log.info("compiled slots: %d rows × %d columns of %s; warm-up compiled %d graphs in %.1f s", self.slots,
                 self.columns, config.cache_kind or "the model's dtype", self.compiles, self.compile_s)

    @property
    def mixing(self) -> bool:  # prompts join in the decode rows' forward (module docstring: mixed)
        return self.native is not None

    @property
    def recompiles(self) -> int:
        """Graphs the engine made since warm-up (this server's loads and anything else on the engine)."""
        return self.engine.stats.recompiles - self._recompiles_at

    def submit(self, request: Request) -> RequestRecord:
        """As Scheduler.submit; a request that cannot fit in one row (prompt + max_new_tokens > S) is an error."""
        need = len(request.prompt_ids) + request.max_new_tokens
        if need <= self.columns:
            return super().submit(request)
        record = RequestRecord(request.id, request.arrival_s, len(request.prompt_ids))
        record.finish, record.error = "error", f"needs {need} columns, the compiled slots hold {self.columns}"
        self.records[request.id] = record
        return record

    # --- slots: the Scheduler's hooks ---------------------------------------------------------------------------

    def _admit(self) -> None:
        if len(self.running) < min(self.config.max_running, self.slots):
            super()._admit()

    def _start_cache(self, live: Live) -> None:  # type: ignore[override]
        """An admitted request gets a free row (nothing written yet: its prefill places it)."""
        live.held = 0
        taken = set(self.slot_of.values())
        self.slot_of[live.request.id] = next(r for r in range(self.slots) if r not in taken)
        return None

    def _share_prefix(self, live: Live) -> int:
        """No blocks are shared: a row copies its prefix at prefill (`_cached_prefix`), so it holds all of its own."""
        return 0

    def _leave(self, live: Live, retain: bool = False) -> None:
        super()._leave(live, retain)
        if self.prefixes is not None:  # a prefix it left retained (`Scheduler._leave`) is copied out of its row
            for key in [k for k in self.prefixes.retained if k not in self.kept]:
                self.kept[key] = self._copy_out(live, self.prefixes.retained[key].held)
            self._forget_evicted()
        row = self.slot_of.pop(live.request.id)
        self.placed.discard(live.request.id)
        if live.request.id in self.staged:
            self.spare.append(self.staged.pop(live.request.id)[1])
        self.mask[row] = 0

    def kv_bytes(self) -> int:
        """The static cache, allocated whole whatever the budget, the staged requests' one-row caches and the
        retained prefixes'."""
        return (cache_bytes(self.cache) + sum(cache_bytes(cache) for _, cache in self.staged.values())
                + sum(cache_bytes(cache) for cache in self.kept.values()))

    def _copy_out(self, live: Live, tokens: int) -> StaticKVCache:
        """The first `tokens` of a placed request's row, columns [0, tokens) of a one-row cache of their own."""
        cache = make_static_cache(self.config.cache_kind, self.model, 1, tokens)
        start = self.pointer - live.held
        cache.take_columns(0, self.cache, self.slot_of[live.request.id], start, start + tokens, shift=-start)
        return cache

    def _forget_evicted(self) -> None:
        """Drop the copies of retained prefixes the index has let go (`Scheduler._hold` and `_leave` evict them)."""
        for key in [k for k in self.kept if self.prefixes is None or k not in self.prefixes.retained]:
            del self.kept[key]

    def _cached_prefix(self, tokens: list[int]) -> Cached:
        """Where the longest run of `tokens`' leading full blocks is held now (at least one token left to feed)."""
        if self.prefixes is None:
            return Cached(self.cache, 0, 0, 0)
        owner, n = self.prefixes.lookup(tokens, len(tokens) - 1)
        if isinstance(owner, Retained):
            return Cached(self.kept[owner.key], 0, 0, n)
        if owner is None or owner.request.id not in self.placed:  # a recomputed owner not back in its row yet
            return Cached(self.cache, 0, 0, 0)
        return Cached(self.cache, self.slot_of[owner.request.id], self.pointer - owner.held, n)

    def _stepping(self) -> list[Live]:
        """Every placed row: decoding, or feeding the outputs of a recomputed KIVI request (`_placed_tokens`)."""
        return [live for live in self.running if live.request.id in self.placed]

    def _placed_tokens(self, live: Live) -> list[int]:
        """What a placement prefills: prompt + outputs but the last (`target`); for KIVI the prompt only, since a
        solo decode fed its outputs one at a time (rows.Flushes.exact), and so do the decode steps after."""
        return live.sequence[:live.target if self.every == 1 else len(live.request.prompt_ids)]

    def _prefill(self, budget: int) -> None:
        """Staged KIVI requests whose turn has come join first. Then whole prefills of the admitted rows, in
        admission order, while `budget` prompt tokens last (at least one), together in one forward (a power of two
        of them, at most PREFILL_ROWS; the rest wait for the next step; KIVI: lengths ≡ the first's mod r): each
        joins its row, or is staged (KIVI, `_joins_now`); a first admission emits its first token either way."""
        for rid, (live, cache) in list(self.staged.items()):
            m = len(self._placed_tokens(live))
            if self._joins_now(m):
                self._join(live, cache, 0, m)
                self.spare.append(self.staged.pop(rid)[1])
        self._forget_evicted()
        group, prefixes = self._group(budget, PREFILL_ROWS, equal_hits=True)
        if not group:
            return
        group = group[:1 << (len(group).bit_length() - 1)]  # a power of two: one cache per group size
        start = self.clock()
        logits = self._place(group, prefixes[:len(group)])  # [k,V]
        first = [i for i, (live, _) in enumerate(group) if not live.record.output_ids]
        tokens = self._choose([group[i][0] for i in first], logits[first]) if first else []  # syncs
        self.forward_s += self.clock() - start
        now = self.clock()
        for i, token in zip(first, tokens):
            self._emit(group[i][0], token, now)

    def _group(self, budget: int, most: int, equal_hits: bool) -> tuple[list[tuple[Live, list[int]]], list[Cached]]:
        """The admitted requests not yet in their rows, in admission order, while `budget` prompt tokens last and
        at most `most` of them → (each with its tokens to place, its cached prefix). KIVI: only lengths ≡ the
        first's mod r; `equal_hits`: only cached prefixes as long as the first's (prompts prefilled together)."""
        group: list[tuple[Live, list[int]]] = []
        prefixes: list[Cached] = []
        for live in [x for x in self.running if x.request.id not in self.placed and x.request.id not in self.staged]:
            if budget <= 0 or len(group) == most:
                break
            tokens = self._placed_tokens(live)
            if group and (len(tokens) - len(group[0][1])) % self.every:
                continue  # KIVI: left pads of whole blocks, so every row's tokens start at a multiple of r
            prefix = self._cached_prefix(tokens)
            if equal_hits and group and prefix.tokens != prefixes[0].tokens:
                continue
            group.append((live, tokens))
            prefixes.append(prefix)
            budget -= len(tokens) - prefix.tokens
        return group, prefixes

    def _joins_now(self, m: int) -> bool:
        """Whether tokens of length m may take their row now: always but for KIVI, where they must start at a
        multiple of r, so m ≡ c (mod r), or no row is placed (c then moves to m)."""
        return self.every == 1 or not self.placed or (m - self.pointer) % self.every == 0

    def _make_room(self, width: int) -> None:
        """Before a step writes column c: at least `width` columns left of c (every placed row's tokens, a joining
        prompt's but its last), c inside the cache, not mostly holes (c < 2·width + SLACK); with no row placed,
        c moves to `width` (nothing to move), else the rows move (`_rebase`)."""
        if not self.placed:
            self.pointer = width
        elif self.pointer == self.columns or self.pointer < width or self.pointer >= 2 * width + SLACK:
            self._rebase(width)

    def _step_inputs(self, rows: list[Live]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,1] ids and positions of a step at column c: each placed row's next token (its last output, or a
        recomputed KIVI row's next output to catch up on), its column c marked in its mask; free rows a pad (0)."""
        ids = torch.zeros(self.slots, 1, dtype=torch.long)  # [B,1]
        positions = torch.zeros_like(ids)  # [B,1]
        for live in rows:
            row = self.slot_of[live.request.id]
            ids[row, 0], positions[row, 0] = live.sequence[live.held], live.held
            self.mask[row, self.pointer] = 1
        return ids, positions

    def _forwards(self, rows: list[Live]) -> None:
        """One step at column c of the placed rows and, when `mixing`, of the prompts the step places (up to
        `max_tokens_per_step` − rows prompt tokens, at least one prompt); else those are prefilled apart after it."""
        budget = self.config.max_tokens_per_step - len(rows)
        group: list[tuple[Live, list[int]]] = []
        if self.mixing:
            self._forget_evicted()
            group = self._group(budget, self.slots, equal_hits=False)[0]
        if rows or group:
            self._decode(rows, group)
        if not self.mixing:
            self._prefill(budget)

    def _decode(self, rows: list[Live], group: list[tuple[Live, list[int]]] | None = None) -> None:
        """One step: every placed row feeds its next token at column c (its last output, or a recomputed KIVI row's
        next output to catch up on; only decoding rows emit); free rows feed a masked pad (they attend only to
        themselves). Each request of `group` (mixing) is written into its own row at columns [c + 1 − m, c + 1):
        its cached prefix copied in, the rest but the last token as the native step's extra tokens, the last as its
        row's token at c, whose logits give a first admission its first token (module docstring: mixed)."""
        start, group = self.clock(), group or []
        self._make_room(max([live.held for live in rows] + [len(tokens) - 1 for _, tokens in group]))
        c = self.pointer
        ids, positions = self._step_inputs(rows)
        extra_ids: list[int] = []
        extra_positions: list[int] = []
        places: list[tuple[int, int]] = []  # (row, column) of each extra token
        for live, tokens in group:
            row, m, first = self.slot_of[live.request.id], len(tokens), c + 1 - len(tokens)
            prefix = self._cached_prefix(tokens)  # where it lies after the rebase
            if prefix.tokens:
                self.cache.take_columns(row, prefix.source, prefix.row, prefix.first, prefix.first + prefix.tokens,
                                        shift=first - prefix.first)
                live.record.cached_prompt_tokens += prefix.tokens
            self.mask[row] = 0
            self.mask[row, first:c + 1] = 1
            ids[row, 0], positions[row, 0] = tokens[-1], m - 1
            extra_ids += tokens[prefix.tokens:m - 1]
            extra_positions += range(prefix.tokens, m - 1)
            places += [(row, first + j) for j in range(prefix.tokens, m - 1)]
        column = torch.tensor([c], device=self.device)  # [1]
        if places:
            assert self.native is not None  # mixing
            extra = Extra(torch.tensor(extra_ids), torch.tensor(extra_positions), torch.tensor(places))
            logits = self.native(self.cache, ids, positions, column, self.mask, extra)  # [B,1,V]
        else:
            logits = self.engine.call(self.key, self.cache, ids.to(self.device), positions.to(self.device), column,
                                      column[0] + 1, self.mask, coding=self.cache.needs_coding(c, 1))  # [B,1,V]
        self.shared_forwards += bool(rows and group)
        emitting = [live for live in rows if live.decoding] + [live for live, _ in group if not live.record.output_ids]
        self.pointer += 1
        for live in rows:
            live.held += 1
        for live, tokens in group:
            live.held = len(tokens)
            self.placed.add(live.request.id)
        rows_logits = rows_of(logits[:, -1], [self.slot_of[live.request.id] for live in emitting])  # [n,V]
        chosen = self._choose(emitting, rows_logits)  # syncs
        self.forward_s += self.clock() - start
        now = self.clock()
        for live, token in zip(emitting, chosen):
            self._emit(live, token, now)

    # --- the static cache -----------------------------------------------------------------------------------------

    def _place(self, group: list[tuple[Live, list[int]]], prefixes: list[Cached]) -> torch.Tensor:
        """Prefill each request's tokens into a static cache of the kind (eager static forward): their cached
        prefix of p tokens (equal in the group) copied into columns [0, p), the rest, k rows left-padded to the
        longest, n, fed into columns [p, p + n) → [k,V] logits of each one's last token; each request joins its
        row (the longest first: one rebase at most) or, KIVI, is staged (`_stage`)."""
        k, p = len(group), prefixes[0].tokens
        n = max(len(tokens) for _, tokens in group) - p
        if k not in self.prefill_caches:
            self.prefill_caches[k] = make_static_cache(self.config.cache_kind, self.model, k, self.columns)
        cache = self.prefill_caches[k]
        state = StaticDecodeState(self.engine, (self.key[0], k, self.columns), cache, k, step_lengths=())
        if p:
            for i, cached in enumerate(prefixes):
                cache.take_columns(i, cached.source, cached.row, cached.first, cached.first + p, shift=-cached.first)
                group[i][0].record.cached_prompt_tokens += p
            state.columns[:, :p] = 1
            state.seen = torch.full((k,), p, device=self.device)
            state.column = state.length = p
        ids = torch.zeros(k, n, dtype=torch.long)  # [k,n] left-padded
        mask = torch.zeros_like(ids)
        for i, (_, tokens) in enumerate(group):
            ids[i, n - len(tokens) + p:], mask[i, n - len(tokens) + p:] = torch.tensor(tokens[p:]), 1
        logits, _ = state.prefill(self.model, ids.to(self.device), mask.to(self.device))  # [k,V]; nothing compiled
        for i in sorted(range(k), key=lambda i: -len(group[i][1])):
            live = group[i][0]
            if self._joins_now(len(group[i][1])):
                self._join(live, cache, i, p + n, p)
            else:
                self._stage(live, cache, i, n)  # KIVI: no cached prefix
        return logits

    def _join(self, live: Live, source: StaticKVCache, i: int, end: int, prefix: int = 0) -> None:
        """The request's m tokens into its row ending at c (after a rebase when m > c; c = m when no row is
        placed), from `source`'s row i: columns [end − m, end), or with a cached prefix of p tokens, [0, p) and
        [end − m + p, end) (left pads lie between)."""
        m = len(self._placed_tokens(live))
        if not self.placed:
            self.pointer = m
        elif m > self.pointer:
            self._rebase(max([m, *(x.held for x in self._stepping())]))
        c, row = self.pointer, self.slot_of[live.request.id]
        if prefix:
            self.cache.take_columns(row, source, i, 0, prefix, shift=c - m)
        self.cache.take_columns(row, source, i, end - m + prefix, end, shift=c - end)
        self.mask[row] = 0
        self.mask[row, c - m:c] = 1
        live.held = m
        self.placed.add(live.request.id)

    def _stage(self, live: Live, source: StaticKVCache, i: int, end: int) -> None:
        """KIVI: the request's prefilled tokens wait in a one-row cache of their own (columns [0, m)) until
        c ≡ m (mod r): its first token is out already; the wait (< r steps) falls between its first and second."""
        m = len(self._placed_tokens(live))
        cache = self.spare.pop() if self.spare else make_static_cache(self.config.cache_kind, self.model, 1,
                                                                      self.columns)
        cache.take_columns(0, source, i, end - m, end, shift=m - end)
        self.staged[live.request.id] = (live, cache)
        live.held = m
        self.stagings += 1

    def _rebase(self, width: int) -> None:
        """Move the columns every placed row holds, [c − W, c) with W the longest row, to [width − W, width): the
        pointer's new place. In place (the cache keeps its address); O(B·W) per layer; columns outside are holes."""
        shift = width - self.pointer
        if shift == 0:
            return
        if width >= self.columns:
            raise RuntimeError(f"no room to rebase to {width} of {self.columns} columns")  # submit refuses these
        placed = self._stepping()
        held = max([live.held for live in placed], default=0)
        log.debug("rebase: pointer %d → %d (%d columns moved)", self.pointer, width, held)
        if held:
            # KIVI: held ≡ c and width ≡ c mod r, whole blocks move
            self.cache.take_columns(slice(None), self.cache, slice(None), self.pointer - held, self.pointer, shift)
        self.mask.zero_()
        for live in placed:
            self.mask[self.slot_of[live.request.id], width - live.held:width] = 1
        self.pointer = width
        self.rebases += 1
