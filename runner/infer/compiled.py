"""The compiled engine: a static cache per (kind, batch bucket, length bucket) and one compiled one-token decode step
per shape, so a generation never recompiles.

In call order (shapes in comments; b real rows, B = bucket(b) ≥ b rows, S columns, T new columns):
    engine_for(model) → CompiledEngine.state(kind, b, columns) → StaticDecodeState.prefill (eager; or compiled in
    `prefill_pieces`, the last padded on the right) → StaticDecodeState.feed → decode_step (compiled: [B,T] ids,
    [B,T] positions, [T] columns, 0-d end of the real ones, [B,S] mask → [B,T,V])
`StaticDecodeState` has DecodeState's methods (prefill, feed) and fields (cache, mask, seen, length), so the
Generator's loop, its sampling, stop rules and beam reordering work on it unchanged; speculative decoding uses
`feed_row` / `get_seq_length` / `crop` on a batch-1 state (verification of k+1 tokens is one compiled step of
T = spec_k + 1; other chunk lengths run the same static forward eagerly). A KIVI cache's one-column step is two
graphs: one without a quantizer for most columns, one for the column in r that completes a block (or a sink).
Rows past b are dummies that attend only to themselves; their logits are dropped.
Compilation: inductor, `dynamic=False`. On CPU the step's few-row products run on runner's kernel
(cpu_linear.OwnProducts rewrites them); where it cannot be built, the step reads the Linear weights from an
input-major copy (`input_major_weights`: where measured faster, per shape and dtype) through
torch.func.functional_call. Inductor's freezing was no faster here (mode "freezing" still selects it). On CUDA,
mode "reduce-overhead" (CUDA graphs) with the cache at a static address and the model's own weights. The first
call of a shape is timed apart (`compile_s`, logged on its own line) by a warm-up step, never inside a decode
timing; inductor's caches live under ~/.cache/runner/inductor, so a second process starts faster. `compiles`
counts graphs dynamo made, `recompiles` those beyond one per shape (a generation that recompiles is a bug this
number shows).
The engine keeps its MAX_CACHES most recently used static caches (a long bench matrix does not hold one per cell).
Owns: the engine registry, buckets, masks of static caches, the compiled step. Does not know about sampling,
stop rules, timing harnesses or manifests.
"""

from __future__ import annotations

import logging
import os
import statistics
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.errors import InferenceError
from runner.infer import cpu_linear
from runner.infer.attention import STATIC_CACHE, reduced_attention
from runner.infer.forward import positions_from, sync
from runner.infer.static import StaticKVCache, make_static_cache
from runner.infer.timing import time_interleaved, time_once
from runner.infer.weights import is_quantized

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_COLUMNS = 256  # length buckets: powers of two from here, capped by the caller's max_seq_len
MAX_CACHES = 3  # static caches an engine keeps (target and draft of a self-drafting model, and one more)
PREFILL_MIN, PREFILL_MAX = 16, 512  # compiled prefill pieces: powers of two between these (prefill_pieces)
CACHE_DIR = Path.home() / ".cache" / "runner" / "inductor"


def batch_bucket(batch: int) -> int:
    """Smallest bucket ≥ batch (past the last: batch itself)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), batch)


def length_bucket(columns: int, max_seq_len: int) -> int:
    """Smallest power of two ≥ columns (at least MIN_COLUMNS), at most max_seq_len."""
    size = MIN_COLUMNS
    while size < columns:
        size *= 2
    return max(min(size, max_seq_len), columns)


def use_compile_cache() -> None:
    """Point inductor's on-disk caches (FX graphs, kernels) at ~/.cache/runner/inductor unless the user chose."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)  # one graph per shape, many shapes


# --- masks over static columns -----------------------------------------------------------------------------------

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
                end: torch.Tensor, mask2d: torch.Tensor, weights: dict | None = None) -> torch.Tensor:
    """[B,T] ids at [B,T] positions into `columns` [T] of the cache (those from `end`, 0-d, on are padding),
    [B,S] real columns → [B,T,V] logits, with the model's own parameters or `weights` in their place. The function
    the engine compiles (one graph per shape); other lengths run it eagerly."""
    cache.columns, cache.end = columns, end
    eager = model.config._attn_implementation == "eager"
    attention = static_mask(mask2d, columns, eager, model.dtype)
    inputs = dict(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                  use_cache=True, logits_to_keep=ids.shape[1], **{STATIC_CACHE: cache})
    out = model(**inputs) if weights is None else torch.func.functional_call(model, weights, (), inputs)
    return out.logits


def input_major_weights(model, repeats: int = 5) -> dict[str, torch.Tensor]:
    """The Linear weights [out,in] that a one-row product reads faster from an input-major copy (same values,
    transposed storage), as views of such copies; the others are left out (functional_call keeps the model's).
    Which layout wins depends on shape, dtype and CPU (measured here: float32's 49k-row head 1.7× faster input-major,
    bfloat16's head and down projection 0.6×), so each distinct (shape, dtype) is timed both ways once, with the
    one harness, and the copy kept where its median is ≥ 5 % faster. Costs the copied weights' bytes; a tied
    embedding reads its rows from the same copy. Quantized weights (tensor subclasses, runner.infer.weights) keep
    their own layout."""
    linears = [(name, module.weight.detach()) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and not is_quantized(module.weight)]
    faster: dict[tuple, bool] = {}
    for _, weight in linears:
        key = (tuple(weight.shape), weight.dtype)
        if key not in faster:
            faster[key] = _input_major_is_faster(weight, repeats)
    log.info("input-major Linear weights for %d of %d shapes: %s", sum(faster.values()), len(faster),
             ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for (shape, dtype), yes in faster.items()
                       if yes) or "none")
    return {f"{name}.weight": weight.t().contiguous().t() for name, weight in linears
            if faster[tuple(weight.shape), weight.dtype]}


def _input_major_is_faster(weight: torch.Tensor, repeats: int) -> bool:
    """Median time of a one-row F.linear with `weight` [out,in] as stored vs from an input-major copy."""
    row = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)  # [1,in]
    layouts = {"stored": weight, "input-major": weight.t().contiguous().t()}
    calls = max(1, int(2e6 // weight.numel()))  # about 2M weights read per timed repeat

    def product(w: torch.Tensor):
        def run_once(tick):
            for _ in range(calls):
                torch.nn.functional.linear(row, w)
            tick()
        return run_once

    marks = time_interleaved({name: product(w) for name, w in layouts.items()}, repeats)
    stored, copied = (statistics.median(m[-1] for m in marks[name]) for name in layouts)
    return copied * 1.05 <= stored


# --- the engine --------------------------------------------------------------------------------------------------

@dataclass
class CompileStats:
    """What compiling cost: seconds per shape (kind, rows, columns, new columns) and graph counts."""

    compile_s: dict[tuple, float] = field(default_factory=dict)
    compiles: int = 0  # graphs dynamo made for the decode step
    recompiles: int = 0  # graphs made after a shape's warm-up: should stay 0

    @property
    def total_s(self) -> float:
        return sum(self.compile_s.values())


class CompiledEngine:
    """One model's compiled decode step and its static caches (one per kind × batch bucket × length bucket).

    A cache is reused by the next state of the same shape: one generation at a time per engine. At most
    `max_caches` are kept (the least recently used goes first, its memory freed once no state holds it), so a
    long bench matrix does not hold one cache per cell; compiled steps stay (a later state of an evicted shape
    allocates a new cache and runs the same graph). `compile=False` runs the same static step eagerly (tests of
    the static path; debugging)."""

    def __init__(self, model, mode: str | None = None, compile: bool = True, max_caches: int = MAX_CACHES):
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.mode = mode or ("reduce-overhead" if self.cuda else "default")
        self.own_products = not self.cuda and cpu_linear.load()  # few-row products on runner's kernel
        self.weights = None if self.cuda or self.own_products else input_major_weights(model)
        if compile:
            use_compile_cache()
            options = compile_options(self.mode, self.own_products)
            self.step = torch.compile(decode_step, dynamic=False, options=options)
        else:
            self.step, self.mode = decode_step, "eager"
        self.caches: OrderedDict[tuple, StaticKVCache] = OrderedDict()  # least recently used first
        self.max_caches = max_caches
        self.warm: set[tuple] = set()  # (kind, rows, columns, new columns) already compiled
        self.stats = CompileStats()

    def state(self, kind: str | None, batch: int, columns: int, max_seq_len: int,
              step_lengths: tuple[int, ...] = (1,), slot: str = "", prefill: int = 0) -> "StaticDecodeState":
        """A fresh state for `batch` rows needing `columns` columns (prompt + new tokens); feeds of
        `step_lengths` new columns run compiled (compiled now, before any timing), others eagerly; `prefill` > 0:
        a prompt of that many columns is fed in compiled pieces (compiled now too). States live at once only in
        different slots (a model drafting for itself: "target" and "draft")."""
        pieces = prefill_pieces(prefill)
        step_lengths = (*step_lengths, *sorted({padded for _, padded in pieces} - set(step_lengths)))
        columns = max(columns, prefill - pieces[-1][0] + pieces[-1][1] if pieces else 0)  # room for the padding
        key = (kind, batch_bucket(batch), length_bucket(columns, max_seq_len))
        cache = self._cache((*key, slot))
        for length in step_lengths:
            if length <= key[2]:
                self._compile(cache, (*key, length))
        return StaticDecodeState(self, cache, batch, step_lengths, compiled_prefill=prefill > 0)

    def _cache(self, key: tuple) -> StaticKVCache:
        """The cache of (kind, rows, columns, slot), made if not kept; the least recently used past max_caches
        dropped."""
        if key in self.caches:
            self.caches.move_to_end(key)
            return self.caches[key]
        while len(self.caches) >= self.max_caches:
            self.caches.popitem(last=False)
        cache = make_static_cache(key[0], self.model, *key[1:3])
        if self.cuda and self.mode == "reduce-overhead":  # CUDA graphs replay on fixed addresses
            for layer in cache.layers:
                for t in layer.tensors():
                    torch._dynamo.mark_static_address(t)
        self.caches[key] = cache
        return cache

    @torch.inference_mode()
    def _compile(self, cache: StaticKVCache, key: tuple) -> None:
        """Compile (or load from inductor's cache) the step of this shape: one warm-up step into the last columns,
        which a state's mask hides and a later write overwrites. Timed on its own and logged."""
        if key in self.warm:
            return
        batch, columns, new = cache.batch, cache.length, key[-1]
        ids = torch.zeros(batch, new, dtype=torch.long, device=self.device)
        span = torch.arange(columns - new, columns, device=self.device)
        mask2d = torch.zeros(batch, columns, dtype=torch.long, device=self.device)
        end = torch.tensor(columns, device=self.device)
        before = _graph_count()
        self.stats.compile_s[key] = 0.0
        for coding in (False, True) if new == 1 and cache.codes_columns() else (new != 1,):
            self._code(cache, new, coding)  # as `call` will
            with reduced_attention(self.model):
                self.stats.compile_s[key] += time_once(  # no aliased inputs
                    lambda: self.step(self.model, cache, ids, torch.zeros_like(ids), span, end, mask2d, self.weights),
                    sync=lambda: sync(self.device))
        self.stats.compiles += _graph_count() - before
        self.warm.add(key)
        if self.mode != "eager":
            log.info("compile: step for %s × %d rows × %d columns × %d new in %.1f s (mode %s)",
                     key[0] or "model dtype", batch, columns, new, self.stats.compile_s[key], self.mode)

    def _code(self, cache: StaticKVCache, new: int, coding: bool) -> None:
        """Set the cache's writes for a step of `new` columns: coding KIVI blocks and sinks (steps of several
        columns always), and handing attention K/V views only where the kernel does not read every layer."""
        cache.code_blocks(new != 1 or coding, views=not (new == 1 and cache.kernel_attends(self.model.dtype)))

    def call(self, cache: StaticKVCache, ids, positions, columns, end, mask2d, coding: bool = False) -> torch.Tensor:
        """The compiled step ([B,T,V] logits); a graph made here is a recompilation, counted and logged. A KIVI
        cache has two one-column graphs: the usual one, which codes no block and keeps no sink (no quantizer in
        it), and `coding`'s, for the one column in r that completes a block or a sink column
        (StaticKVCache.needs_coding)."""
        before = _graph_count()
        self._code(cache, ids.shape[1], coding)
        with reduced_attention(self.model):
            logits = self.step(self.model, cache, ids, positions, columns, end, mask2d, self.weights)
        made = _graph_count() - before
        if made:
            self.stats.compiles += made
            self.stats.recompiles += made
            log.warning("the compiled decode step recompiled (%d graphs) for %s × %d rows × %d columns × %d new",
                        made, cache.kind, cache.batch, cache.length, ids.shape[1])
        return logits


def _graph_count() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compile_options(mode: str, own_products: bool = False) -> dict:
    """Inductor's options for `mode` ("default", "reduce-overhead", "freezing"), with `emulate_precision_casts`:
    without it inductor drops a float → fp16 → float round trip inside a fused kernel, so a quantizer that rounds
    its scale or minimum to fp16 and then codes against it coded against the unrounded value: the compiled engine
    stored other KIVI codes than the eager one (one layer, 312 columns written one by one: 12 % of kivi2's scales
    differed), and greedy text parted from eager's after 141 tokens with kivi2:g128:r128:s4:o2:b64:nuq on SmolLM2."""
    extra = {"freezing": True} if mode == "freezing" else torch._inductor.list_mode_options(mode)
    if own_products:  # few-row products on runner's kernel (cpu_linear)
        extra["post_grad_custom_post_pass"] = cpu_linear.OwnProducts()
    return {"emulate_precision_casts": True, **extra}


def engine_for(model) -> CompiledEngine:
    """The model's engine, made once per model object: compiled steps and caches outlive one Generator."""
    if model not in _ENGINES:
        _ENGINES[model] = CompiledEngine(model)
    return _ENGINES[model]


def check_compilable(model) -> None:
    """InferenceError when the compiled engine cannot serve this model (every cache kind has a static layout)."""
    text = model.config.get_text_config(decoder=True)
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise InferenceError(f"engine 'compiled' serves models whose layers all use full attention; "
                             f"{text.model_type} has {sorted(types)}: use engine: eager")


# --- the state the Generator and the speculative rounds drive ------------------------------------------------------

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
    """DecodeState over a static cache: b real rows of a B-row cache, `length` columns written so far."""

    def __init__(self, engine: CompiledEngine, cache: StaticKVCache, batch: int, step_lengths: tuple[int, ...],
                 compiled_prefill: bool = False):
        self.engine, self.cache, self.rows, self.step_lengths = engine, cache, batch, step_lengths
        self.compiled_prefill = compiled_prefill  # prompts in compiled pieces (prefill_pieces), not eagerly
        self.columns = torch.zeros(cache.batch, cache.length, dtype=torch.long, device=engine.device)  # [B,S]
        self.seen: torch.Tensor | None = None  # [b] real tokens so far
        self.length = 0

    @property
    def mask(self) -> torch.Tensor:
        """[b,length] mask of what was fed (DecodeState's field)."""
        return self.columns[:self.rows, :self.length]

    def _pad(self, t: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[b,...] → [B,...], dummy rows filled with `fill`."""
        extra = self.cache.batch - self.rows
        return t if extra == 0 else torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])

    def _forward(self, model, ids: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
                 compiled: bool = True, real: int | None = None) -> torch.Tensor:
        """[b,T] ids, positions and mask into the next T columns → [b,T,V] logits; compiled when T is a step
        length, else the same static forward run eagerly. Only the first `real` columns (default all) count: the
        rest are padding, masked, and the next write goes over them."""
        t = ids.shape[1]
        real = t if real is None else real
        if self.length + t > self.cache.length:
            raise InferenceError(f"the compiled engine's cache holds {self.cache.length} columns; this call needs "
                                 f"{self.length + t}: raise max_seq_len or start a new conversation")
        columns = torch.arange(self.length, self.length + t, device=ids.device)  # [T]
        self.columns[:, self.length:self.length + t] = self._pad(new_mask)
        args = (self.cache, self._pad(ids), self._pad(positions), columns, columns[real - 1] + 1, self.columns)
        if compiled and t in self.step_lengths:
            logits = self.engine.call(*args, coding=t == 1 and self.cache.needs_coding(self.length, real))
        else:
            self.engine._code(self.cache, t, True)
            with reduced_attention(model):
                logits = decode_step(model, *args, self.engine.weights if model is self.engine.model else None)
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
            logits = self._forward(model, ids[:, part], positions[:, part], new_mask[:, part], compiled=False)
        return logits[:, -1], None

    def feed(self, model, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """One compiled decode step: [b] token (live [b] 0/1: a finished row feeds a masked pad) → [b,V] logits."""
        positions = self.seen[:, None]  # [b,1]
        self.seen = self.seen + live
        return self._forward(model, token[:, None], positions, live[:, None])[:, -1]

    # speculative rounds: one row, no padding, the cache rolled back after a rejection

    def get_seq_length(self) -> int:
        return self.length

    def feed_row(self, model, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Batch 1: [t] tokens appended → [keep,V] float32 logits of the last `keep` of them."""
        positions = torch.arange(self.length, self.length + tokens.shape[0], device=tokens.device)[None]
        logits = self._forward(model, tokens[None], positions, torch.ones_like(tokens)[None])
        return logits[0, -keep:].float()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove columns (a negative count, as transformers' crop): their mask goes to
        0 and the next write overwrites them (KIVI: kept columns leave the quantized region, `rollback`)."""
        held = self.length
        self.length += tokens_to_remove
        self.columns[:, self.length:] = 0
        self.cache.rollback(self.length, held)

    @property
    def layers(self) -> list:
        """The cache's layers (what speculative.tokens_before_flush reads their residual length from)."""
        return self.cache.layers
