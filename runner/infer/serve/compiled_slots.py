"""Continuous batching on the compiled engine: requests join and leave the rows ("slots") of one static cache.

The cache has B = batch_bucket(max_running) rows and S = `columns` columns (mode serve: a length bucket); a row is
a slot. All rows decode at one shared column pointer c: the one compiled step (kind, B, S, 1 new column) writes
every row's new token at column c, each row with its own position (its tokens so far) and its own [S] mask, so its
attention and RoPE are those of a solo decode. A running request holds columns [c − held, c) of its row,
right-aligned to c.
    join     the whole prompt (after a preemption: prompt + outputs but the last) is prefilled alone, batch 1, through
             a static cache of the same kind (the engine's static forward, run eagerly), so its K/V are in the stored
             format; they are copied into its row ending at column c. A row whose prefix does not fit left of c
             moves every row right first (rebase).
    rebase   when c reaches S, or a joining prompt is longer than c, or c ≥ 2·W + SLACK (W = the longest row: on
             CPU attention reads columns [0, c], so holes cost time): the columns [c − W, c) move (in place, the
             cache keeps its address: CUDA graphs) so that all rows end at W, or at the joining prompt's length;
             columns left of a row's tokens are masked holes.
So the load runs one compiled shape, compiled during warm-up (`CompiledSlots.__init__`, before the clock starts):
`recompiles` counts graphs dynamo made after that (should stay 0), `compile_s` is the warm-up's compile time.

The scheduler's rules are serve/scheduler.Scheduler's (this is a subclass): KV blocks accounted by blocks.py,
first come first served admission by free blocks (and free slots: max_running ≤ B), preemption by recompute of the
most recently admitted, the same finish rules and sampling. Per request, greedy output equals its solo greedy decode
up to float reductions over masked columns (near ties only): a row's stored K/V are a solo decode's (per-token kinds
quantize each column alone, so where a column lies changes nothing).
What it does not do: KIVI (`compiled_serve_reason`), chunked prefill (a prompt is prefilled whole, in the step it
is admitted in, up to `max_tokens_per_step` prompt tokens a step but always at least one prompt), compiled prefill,
prefix caching, requests longer than S (refused at submission), several length buckets (a longer S is another
server). A rebase copies B·W columns per layer, once per ≥ W + SLACK steps.
"""

from __future__ import annotations

import logging

import torch

from runner.infer.cache.static.cache import make_static_cache
from runner.infer.compiled.engine import CompiledEngine, engine_for
from runner.infer.compiled.state import StaticDecodeState
from runner.infer.config.kinds import compiled_serve_reason
from runner.infer.serve.requests import Request, RequestRecord
from runner.infer.serve.scheduler import Clock, Live, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

SLOT = "serve"  # the engine cache slot the server's static cache lives in (apart from a Generator's)
SLACK = 64  # columns of holes past twice the longest row that trigger a rebase before the cache is full


class CompiledSlots(Scheduler):
    """The continuous-batching scheduler over the compiled engine's one static cache (module docstring).
    `columns`: S, the most tokens (prompt + new) one request may hold (a power of two ≥ 256 is a length bucket of
    the engine's; any other count is taken as it is); `engine`: the
    model's compiled engine by default (tests pass CompiledEngine(model, compile=False))."""

    def __init__(self, model, config: SchedulerConfig | None = None, clock: Clock | None = None, tokenizer=None,
                 columns: int = 512, engine: CompiledEngine | None = None):
        config = config or SchedulerConfig()
        if reason := compiled_serve_reason(config.cache_kind):
            raise ValueError(f"cache kind {config.cache_kind!r} cannot be served on the compiled engine: {reason}")
        if config.prefix_caching:
            log.warning("prefix caching is off on the compiled engine (prompts are prefilled whole, then copied)")
        super().__init__(model, config, clock, tokenizer)
        self.prefixes = None
        self.engine = engine or engine_for(model)
        before = self.engine.stats.reading()
        state = self.engine.state(config.cache_kind, config.max_running, columns, columns,
                                  slot=SLOT)  # compiles the one step (kind, B, S, 1) now
        after = self.engine.stats.reading()
        self.compile_s, self.compiles = after[0] - before[0], after[1] - before[1]
        self._recompiles_at = after[2]
        self.key, self.cache = state.key, state.cache  # key: (kind, B, S)
        self.slots, self.columns = self.cache.batch, self.cache.length
        self.prefill_cache = make_static_cache(config.cache_kind, model, 1, self.columns)
        with torch.inference_mode():  # an inference tensor, as the step was compiled for (else guards fail)
            self.mask = torch.zeros(self.slots, self.columns, dtype=torch.long, device=self.device)  # [B,S]
        self.pointer = 0  # c: the column every row writes next
        self.slot_of: dict[int, int] = {}  # request id → its row
        self.placed: set[int] = set()  # request ids whose K/V are in their row
        self.rebases = 0
        log.info("compiled slots: %d rows × %d columns of %s; warm-up compiled %d graphs in %.1f s", self.slots,
                 self.columns, config.cache_kind or "the model's dtype", self.compiles, self.compile_s)

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

    def _leave(self, live: Live) -> None:
        super()._leave(live)
        row = self.slot_of.pop(live.request.id)
        self.placed.discard(live.request.id)
        self.mask[row] = 0

    def _prefill(self, budget: int) -> None:
        """Whole prefills of the admitted rows, in admission order, while `budget` prompt tokens last (at least
        one): each placed in its row; a first admission emits its first token."""
        for live in [x for x in self.running if x.request.id not in self.placed]:
            if budget <= 0:
                break
            start = self.clock()
            tokens = live.sequence[:live.target]
            logits = self._place(live, tokens)  # [V]
            budget -= len(tokens)
            sample = not live.record.output_ids
            token = self._choose([live], logits[None])[0] if sample else None  # syncs
            self.forward_s += self.clock() - start
            if token is not None:
                self._emit(live, token, self.clock())

    def _decode(self, rows: list[Live]) -> None:
        """One compiled step: every placed row feeds its last output token at column c; free rows feed a masked pad
        (they attend only to themselves)."""
        start = self.clock()
        width = max(live.held for live in rows)
        if self.pointer == self.columns or self.pointer >= 2 * width + SLACK:  # full, or mostly holes
            self._rebase(width)
        c = self.pointer
        ids = torch.zeros(self.slots, 1, dtype=torch.long)  # [B,1]
        positions = torch.zeros_like(ids)  # [B,1]
        row_of = [self.slot_of[live.request.id] for live in rows]
        for live, row in zip(rows, row_of):
            ids[row, 0], positions[row, 0] = live.record.output_ids[-1], live.held
            self.mask[row, c] = 1
        column = torch.tensor([c], device=self.device)  # [1]
        logits = self.engine.call(self.key, self.cache, ids.to(self.device), positions.to(self.device), column,
                                  column[0] + 1, self.mask)  # [B,1,V]
        self.pointer += 1
        for live in rows:
            live.held += 1
        chosen = self._choose(rows, logits[row_of, -1])  # syncs (tolist)
        self.forward_s += self.clock() - start
        now = self.clock()
        for live, token in zip(rows, chosen):
            self._emit(live, token, now)

    # --- the static cache -----------------------------------------------------------------------------------------

    def _place(self, live: Live, tokens: list[int]) -> torch.Tensor:
        """Prefill `tokens` alone (batch 1, the kind's static layout, eager static forward) and copy their K/V into
        the request's row, ending at column c → [V] logits of the last token."""
        n = len(tokens)
        if n > self.pointer:
            self._rebase(max([n, *(x.held for x in self.running if x.request.id in self.placed)]))
        key = (self.key[0], 1, self.columns)
        state = StaticDecodeState(self.engine, key, self.prefill_cache, 1, step_lengths=())  # nothing compiled
        ids = torch.tensor([tokens], device=self.device)  # [1,n]
        logits, _ = state.prefill(self.model, ids, torch.ones_like(ids))  # [1,V]
        row, c = self.slot_of[live.request.id], self.pointer
        for into, source in zip(self.cache.static_layers, self.prefill_cache.static_layers):
            for whole, part in zip(into.tensors(), source.tensors()):  # [B,H,S,...] ← [1,H,S,...]
                whole[row, :, c - n:c] = part[0, :, :n]
        self.mask[row] = 0
        self.mask[row, c - n:c] = 1
        live.held = n
        self.placed.add(live.request.id)
        return logits[0]

    def _rebase(self, width: int) -> None:
        """Move the columns every placed row holds, [c − W, c) with W the longest row, to [width − W, width): the
        pointer's new place. In place (the cache keeps its address); O(B·W) per layer; columns outside are holes."""
        shift = width - self.pointer
        if shift == 0:
            return
        if width >= self.columns:
            raise RuntimeError(f"no room to rebase to {width} of {self.columns} columns")  # submit refuses these
        placed = [live for live in self.running if live.request.id in self.placed]
        held = max([live.held for live in placed], default=0)
        log.debug("rebase: pointer %d → %d (%d columns moved)", self.pointer, width, held)
        if held:
            source, into = slice(self.pointer - held, self.pointer), slice(width - held, width)
            for layer in self.cache.static_layers:
                for t in layer.tensors():  # [B,H,S,...]
                    t[:, :, into] = t[:, :, source].clone()
        self.mask.zero_()
        for live in placed:
            self.mask[self.slot_of[live.request.id], width - live.held:width] = 1
        self.pointer = width
        self.rebases += 1
