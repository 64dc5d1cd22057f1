"""Continuous batching on the eager engine: requests join and leave the batch at token boundaries.

One `Scheduler.step()`, in order:
    grow   every decoding row gets the block its next token needs; none free → preempt the most recently admitted
           running request (its blocks freed, back to the front of the waiting queue, recomputed later from its
           prompt + the tokens it has made; never dropped; `RequestRecord.preemptions` counts it)
    admit  waiting requests, first come first served, while the blocks for all they must prefill are free
    decode one batched forward of the decoding rows (serve/rows.py: each row's own cache, its exact K/V); with
           `spec_k`, a greedy row feeds its last token and a draft of ≤ spec_k tokens (as its blocks allow) from
           prompt lookup on its own sequence, or from a draft model (serve/drafting.py: k batched forwards of the
           draft before the verify), keeps the draft's prefix that is the target's argmax and one more token, and
           crops the rest from its cache (kinds that store each token alone: a crop leaves no trace)
    prefill chunks of the admitted requests under the step's token budget (`max_tokens_per_step` − decode rows),
           in one more forward (rows.feed_rows); a chunk ends where the kind's stored K/V stay those of a solo
           decode (rows.chunk_end)
A request samples by its own `Request.sampling` when it has one (an HTTP request's temperature, top_p, seed, stop
strings), else by the scheduler's. `cancel` takes a request out at once (its client went away): its blocks and cache
are freed, `finish="cancelled"`.
A request finishes on EOS (once `min_new_tokens` are out; before that EOS is an ordinary token, as vLLM's
ignore_eos), a stop string, `max_new_tokens` or `max_seq_len`. A bounded waiting queue refuses what does not fit
(`finish="refused"`); a request whose prompt + max_new_tokens exceeds the whole KV budget is refused at submission
(`finish="error"`), so a lone request always fits and nothing waits forever.

Memory: for the kinds that store each token alone, the K/V live in one physical pool (serve/paged.py) in the very
blocks the BlockPool counts, and never past the budget's; a KIVI request keeps its own cache (its blocks counted).
Exactness: every request's stored K/V are a solo decode's (its blocks or its own cache, chunks that end where
rows.Flushes says), so greedy output equals its solo greedy decode up to float reductions over masked columns (near
ties only). Seeded sampling draws from the request's own torch.Generator (`request_seed`): what else is in the batch
never changes it.
Prefix caching (`prefix_caching`, serve/prefix.py) starts a new request's block table with the full prompt blocks of
a running or finished request (shared, stored once), so its prefill skips them and its memory holds them once;
finished requests' prompt blocks are kept up to `prefix_cache_blocks`, charged to the budget and dropped (least
recently used first) before anyone waits or is preempted for blocks. What it does not do: KIVI in the pool, CUDA
graphs or compiled steps (serve/compiled_slots.py).
Times come from the injected clock (seconds of the load); `timeline` records (t_s, running, blocks_used, waiting)
per step.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
from transformers.cache_utils import Cache

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import eos_ids
from runner.infer.decode.sampling import greedy_tokens, next_token
from runner.infer.serve.blocks import BlockPool, block_spec, blocks_in
from runner.infer.serve.drafting import DraftRows
from runner.infer.serve.live import Clock, Live, SchedulerConfig, request_seed
from runner.infer.serve.paged import PagedStore, pageable
from runner.infer.serve.prefix import PrefixIndex, Retained
from runner.infer.serve.requests import Request, RequestRecord
from runner.infer.serve.rows import Flushes, chunk_end, feed_rows, rows_reason
from runner.infer.speculative.rounds import lookup_proposal

log = logging.getLogger(__name__)

class Scheduler:
    """Waiting and running queues over one model. `submit` at arrival, `step` while `busy`; `records` at the end."""

    def __init__(self, model, config: SchedulerConfig | None = None, clock: Clock | None = None, tokenizer=None,
                 draft=None):
        self.config = config or SchedulerConfig()
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.clock: Clock = clock or _zero
        self.tokenizer = tokenizer
        if self.config.sampling.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: Scheduler(..., tokenizer=tok)")
        self.eos = eos_ids(model, self.config.sampling.eos_token_id)
        probe = make_cache(self.config.cache_kind, model)
        if reason := rows_reason(probe):
            raise ValueError(f"cache kind {self.config.cache_kind!r} cannot be scheduled: {reason}")
        self.flushes = Flushes.of(probe)
        if self.config.spec_k and self.flushes.every != 1:
            raise ValueError(f"speculation needs a cache kind that stores each token alone: {self.config.cache_kind} "
                             f"codes groups of {self.flushes.every} tokens, which a rejected draft would leave coded")
        spec = block_spec(model.config, self.config.cache_kind, self.config.block_size, model.dtype)
        total = (self.config.num_blocks if self.config.num_blocks is not None
                 else blocks_in(self.config.kv_budget_bytes, spec) if self.config.kv_budget_bytes is not None
                 else 2**62)
        self.pool = BlockPool(spec, total)
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.store = (PagedStore(self.config.cache_kind, model.dtype, n_layers, self.config.block_size, total)
                      if pageable(self.config.cache_kind) else None)  # None: each request's cache is its own (KIVI)
        caching = self.config.prefix_caching and self.store is not None
        if self.config.prefix_caching and not caching:
            log.warning("prefix caching is off for %s: its stored K/V depend on how the prompt was fed",
                        self.config.cache_kind)
        self.prefixes = PrefixIndex(self.config.block_size) if caching else None
        self.waiting: deque[Live] = deque()
        self.running: list[Live] = []  # in admission order: the last is preempted first
        self.records: dict[int, RequestRecord] = {}
        self.timeline: list[tuple[float, int, int, int]] = []  # (t_s, running, blocks used, waiting) per step
        self.forward_s = 0.0  # seconds inside model forwards (profiling: the rest of step() is the scheduler's)
        self.drafted = self.accepted = 0  # speculation: draft tokens verified, and accepted
        if draft is not None and not self.config.spec_k:
            raise ValueError("a draft model proposes spec_k tokens a step: set spec_k ≥ 1")
        self.drafter = DraftRows(draft) if draft is not None else None  # None: prompt lookup

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, request: Request) -> RequestRecord:
        """A request arrives: it waits, or is refused (queue full; or longer than the whole KV budget)."""
        record = RequestRecord(request.id, request.arrival_s, len(request.prompt_ids))
        self.records[request.id] = record
        need = self.pool.spec.blocks_for(len(request.prompt_ids) + request.max_new_tokens)
        if need > self.pool.total:
            record.finish, record.error = "error", f"needs {need} KV blocks, the budget has {self.pool.total}"
        elif self.config.max_queue is not None and len(self.waiting) >= self.config.max_queue:
            record.finish, record.error = "refused", f"waiting queue full ({self.config.max_queue})"
        else:
            own = request.sampling
            if own is not None and own.stop_strings and self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer: Scheduler(..., tokenizer=tok)")
            seed = own.seed if own is not None and own.seed is not None else request_seed(
                self.config.sampling.seed, request.id)  # a request's own seed: the same tokens whatever its id
            rng = torch.Generator(self.device).manual_seed(seed)
            self.waiting.append(Live(request, record, rng))
        return record

    @torch.inference_mode()  # the compiled slots zero the row's mask, an inference tensor
    def cancel(self, request_id: int) -> bool:
        """Take a waiting or running request out now (`finish="cancelled"`), freeing its blocks and cache; False when
        it is not held (unknown, or already finished)."""
        for live in self.waiting:
            if live.request.id == request_id:
                self.waiting.remove(live)
                break
        else:
            live = next((x for x in self.running if x.request.id == request_id), None)  # type: ignore[assignment]
            if live is None:
                return False
            self._leave(live)
        live.record.finish = "cancelled"
        return True

    def kv_bytes(self) -> int:
        """Bytes of KV storage allocated now: the pool's whole storage, or (KIVI) the running requests' own caches."""
        if self.store is not None:
            return self.store.nbytes()
        return sum(cache_bytes(live.cache) for live in self.running if live.cache is not None)

    def sampling_of(self, live: Live) -> GenerateConfig:
        return live.request.sampling or self.config.sampling

    @torch.inference_mode()
    def step(self) -> None:
        """Grow, admit, one batched decode, prefill chunks under the token budget."""
        self._grow()
        self._admit()
        self._forwards(self._stepping())
        self.timeline.append((self.clock(), len(self.running), self.pool.used, len(self.waiting)))

    def _forwards(self, rows: list[Live]) -> None:
        """The step's forwards: one batched decode of `rows`, then prefill chunks under the token budget."""
        if rows:
            self._decode(rows)
        self._prefill(self.config.max_tokens_per_step - len(rows))

    def _stepping(self) -> list[Live]:
        """The rows the step's decode forward feeds: every decoding row."""
        return [live for live in self.running if live.decoding]

    def _grow(self) -> None:
        """Every decoding row's next token gets its block; preempt the latest admitted while one is missing."""
        for live in [x for x in self.running if x.decoding]:
            while live in self.running and not self._hold(live.request.id, live.held + 1):
                self._preempt(self.running[-1])

    def _preempt(self, live: Live) -> None:
        log.debug("preempting request %d (%d tokens held)", live.request.id, live.held)
        self._leave(live)
        live.held = 0
        live.record.preemptions += 1
        self.waiting.appendleft(live)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            live = self.waiting[0]
            live.held = self._share_prefix(live)
            if not self._hold(live.request.id, live.target):
                self.pool.release(live.request.id)
                live.held = 0
                return
            self.waiting.popleft()
            live.record.cached_prompt_tokens += live.held
            live.cache = self._start_cache(live)
            if live.record.scheduled_s is None:
                live.record.scheduled_s = self.clock()
            self.running.append(live)

    def _hold(self, rid: int, tokens: int) -> bool:
        """The pool's hold, dropping retained prefixes (least recently used first) while blocks are short: they
        go before anyone is kept waiting or preempted."""
        while not self.pool.hold(rid, tokens):
            if self.prefixes is None or not self.prefixes.retained:
                return False
            self.pool.release(self.prefixes.evict_oldest().key)
        return True

    def _share_prefix(self, live: Live) -> int:
        """Start a waiting request's block table with the longest run of full prompt blocks a running or retained
        request holds (at least one token is left to prefill: its logits give the next token) → their tokens."""
        if self.prefixes is None:
            return 0
        owner, tokens = self.prefixes.lookup(live.sequence, live.target - 1)
        if owner is None:
            return 0
        holder = owner.key if isinstance(owner, Retained) else owner.request.id
        self.pool.share(live.request.id, holder, tokens // self.config.block_size)
        return tokens

    def _start_cache(self, live: Live) -> Cache:
        """An admitted request's cache: over its block table in the pool (its shared prefix, `live.held` tokens,
        already there), or for KIVI its own."""
        if self.store is None:
            return make_cache(self.config.cache_kind, self.model)
        return self.store.cache(self.pool.tables[live.request.id], live.held)

    def _decode(self, rows: list[Live]) -> None:
        """One forward of every decoding row: each feeds its last output token, and with spec_k its draft."""
        drafts = self._drafts(rows) if self.config.spec_k else [[] for _ in rows]
        self._forward(rows, [[live.record.output_ids[-1], *d] for live, d in zip(rows, drafts)], [True] * len(rows),
                      drafts)

    def _drafts(self, rows: list[Live]) -> list[list[int]]:
        """Each greedy row's draft: ≤ spec_k tokens, fewer where its length limits or free blocks leave less room
        (the verify emits the accepted ones and one more); from prompt lookup or the draft model."""
        ks = [self._room(live) for live in rows]
        if self.drafter is None:
            drafts = [lookup_proposal(torch.tensor(live.sequence), k).tolist() if k else []
                      for live, k in zip(rows, ks)]
        else:
            start = self.clock()
            drafts = self.drafter.propose([(live.request.id, live.sequence, k) for live, k in zip(rows, ks)])
            self.forward_s += self.clock() - start
        for live, draft in zip(rows, drafts):
            while draft and not self.pool.hold(live.request.id, live.held + 1 + len(draft)):  # free blocks only: a
                draft.pop()  # draft never drops a retained prefix nor makes anyone wait
        return drafts

    def _room(self, live: Live) -> int:
        """Tokens a row may draft this step: none when it samples, else spec_k within its length limits."""
        sampling = self.sampling_of(live)
        if not _plain(sampling):
            return 0
        room = min(live.request.max_new_tokens - len(live.record.output_ids),
                   sampling.max_seq_len - len(live.sequence)) - 1
        return max(min(self.config.spec_k, room), 0)

    def _prefill(self, budget: int) -> None:
        """Chunks of the prefilling requests, in admission order, while the budget lasts, in one forward (the
        step's first chunk may go over the budget when no exact end fits in it, KIVI's flush alignment: never a
        stall)."""
        rows: list[Live] = []
        chunks: list[list[int]] = []
        for live in [x for x in self.running if not x.decoding]:
            if budget <= 0:
                break
            prompt = len(live.request.prompt_ids)
            end, fits = chunk_end(live.held, live.held + budget, live.target, prompt, self.flushes)
            if not (fits or not rows):
                break
            rows.append(live)
            chunks.append(live.sequence[live.held:end])
            budget -= end - live.held
        if rows:  # a row whose prompt is now in samples its first token; a recomputed one goes on decoding
            self._forward(rows, chunks, [live.held + len(c) == live.target and not live.record.output_ids
                                         for live, c in zip(rows, chunks)])

    def _forward(self, rows: list[Live], chunks: list[list[int]], sampled: list[bool],
                 drafts: list[list[int]] | None = None) -> None:
        """One forward of `rows`, each feeding its chunk; the rows marked `sampled` choose and emit a token, or
        those with a draft (the chunk's tail) the tokens their verify accepts and one more."""
        start = self.clock()
        drafts = drafts or [[] for _ in rows]
        caches = [live.cache for live in rows]
        logits = feed_rows(self.model, chunks, caches, [live.held for live in rows],  # type: ignore[arg-type]
                           keep=1 + max(map(len, drafts)))  # [B,keep,V]
        for live, chunk in zip(rows, chunks):
            live.held += len(chunk)
        picked = [r for r, s in enumerate(sampled) if s and not drafts[r]]
        chosen = self._choose([rows[r] for r in picked], rows_of(logits[:, -1], picked)) if picked else []  # syncs
        emitted = {r: [token] for r, token in zip(picked, chosen)}
        if any(drafts):
            argmax = greedy_tokens(logits.flatten(0, 1)).view(len(rows), -1).tolist()  # [B,keep], one sync
            emitted |= {r: self._verify(rows[r], d, argmax[r][-len(d) - 1:]) for r, d in enumerate(drafts) if d}
        self.forward_s += self.clock() - start
        now = self.clock()
        for r in sorted(emitted):
            for token in emitted[r]:
                self._emit(rows[r], token, now)
                if rows[r].record.finish:
                    break

    def _verify(self, live: Live, draft: list[int], target: list[int]) -> list[int]:
        """Greedy verify: the target's argmax after the last output and after each of the k drafted tokens [k+1] →
        the draft's prefix that matches, then the target's next token; the rejected drafts are cropped from the
        row's cache and their blocks given back."""
        n = next((i for i, (x, y) in enumerate(zip(draft, target)) if x != y), len(draft))
        if n < len(draft):
            live.cache.crop(n - len(draft))  # type: ignore[union-attr]  # a negative count: the last ones go
            live.held -= len(draft) - n
            self.pool.trim(live.request.id, live.held)
        self.drafted += len(draft)
        self.accepted += n
        return target[:n + 1]

    def _choose(self, rows: list[Live], logits: torch.Tensor) -> list[int]:
        """[B,V] logits → each row's next token: greedy as one argmax; sampling from each row's own generator."""
        configs = [self.sampling_of(live) for live in rows]
        plain = [_plain(c) for c in configs]
        if all(plain):
            return greedy_tokens(logits).tolist()
        chosen = []
        for r, live in enumerate(rows):
            if plain[r]:
                chosen.append(int(greedy_tokens(logits[r:r + 1])[0]))
                continue
            seen = torch.tensor([live.sequence], device=self.device)  # [1,n] penalties read it
            chosen.append(int(next_token(logits[r:r + 1], seen, configs[r], live.rng)[0]))
        return chosen

    def _emit(self, live: Live, token: int, now: float) -> None:
        record, request = live.record, live.request
        record.output_ids.append(token)
        record.token_s.append(now)
        n = len(record.output_ids)
        finish = ("eos" if token in self.eos and n >= request.min_new_tokens
                  else "stop" if self._hit_stop_string(live)
                  else "length" if n >= request.max_new_tokens
                  or len(request.prompt_ids) + n >= self.sampling_of(live).max_seq_len else "")
        if finish:
            record.finish = finish
            self._leave(live, retain=True)
        elif n == 1 and self.prefixes is not None:  # its prompt is in: later requests may share its blocks
            self.prefixes.add(live, request.prompt_ids)

    def _leave(self, live: Live, retain: bool = False) -> None:
        """Out of the running batch: its blocks and cache go, and its prompt blocks stop being offered, or with
        `retain` (it finished) stay offered as a retained prefix, within prefix_cache_blocks."""
        self.running.remove(live)
        if self.drafter is not None:
            self.drafter.drop(live.request.id)
        live.cache = None
        if self.prefixes is not None and retain and self.config.prefix_cache_blocks > 0:
            kept = self.prefixes.retire(live)
            if kept is not None:  # its full prompt blocks stay, shared with whoever else holds them
                self.pool.share(kept.key, live.request.id, kept.held // self.config.block_size)
        self.pool.release(live.request.id)
        if self.prefixes is None:
            return
        self.prefixes.remove(live)
        for other in self.running:  # who shares the blocks it offered offers them now (a preempted or cancelled
            if other.record.output_ids:  # owner's prefix stays findable while anyone holds it)
                self.prefixes.add(other, other.request.prompt_ids)
        retained = self.prefixes.retained
        while retained and sum(self.pool.held[k] for k in retained) > self.config.prefix_cache_blocks:
            self.pool.release(self.prefixes.evict_oldest().key)

    def _hit_stop_string(self, live: Live) -> bool:
        """The Generator's rule: a stop string in the decoded tail of this request's new tokens."""
        stops = self.sampling_of(live).stop_strings
        if not stops:
            return False
        tail = max(len(s) for s in stops) + 8  # tokens: enough to hold the longest stop string
        text = self.tokenizer.decode(live.record.output_ids[-tail:], skip_special_tokens=False)
        return any(s in text for s in stops)


def _plain(config: GenerateConfig) -> bool:
    """Greedy with nothing that reads past tokens: the next token is the logits' argmax."""
    return config.greedy and config.repetition_penalty == 1.0 and not config.no_repeat_ngram_size


def _zero() -> float:
    return 0.0


def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] of [B,V] logits: a view where the rows are consecutive and ascending (the usual case: all of a
    forward's rows sample; a full batch of slots is taken lowest first), else a copy. Indexing with a list copied a
    16-row bfloat16 Qwen step's logits in 2.8 ms, 4 % of the step; with a tensor of the rows, 1.0 ms."""
    first = rows[0] if rows else 0
    if rows == list(range(first, first + len(rows))):
        return logits[first:first + len(rows)]
    return logits[torch.tensor(rows)]
