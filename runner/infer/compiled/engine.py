"""The compiled engine: a static cache per (kind, batch bucket, length bucket) and one compiled one-token decode step
per shape, so a generation never recompiles.

In call order (shapes in comments; b real rows, B = bucket(b) ≥ b rows, S columns, T new columns):
    engine_for(model) → CompiledEngine.state(kind, b, columns) → StaticDecodeState.prefill (eager, or compiled
    `prefill_pieces`) → .feed → CompiledEngine.call → decode_step
    (compiled: [B,T] ids, [B,T] positions, [T] columns, 0-d end of the real ones, [B,S] mask → [B,T,V])
Speculative verification of k+1 tokens is one compiled step of T = spec_k + 1; other chunk lengths run the same
static forward eagerly. A KIVI cache's one-column step is two graphs: one without a quantizer, one for the column
that completes a block (or a sink).

Compilation: inductor, `dynamic=False`. On CPU the step's few-row products run on runner's kernel
(cpu_linear.OwnProducts); where it cannot be built, the step reads input-major weight copies where those are faster.
On CUDA, mode "reduce-overhead" (CUDA graphs) with the cache at a static address; a graph's logits are cloned, since
its next replay overwrites them. A shape's first call is a warm-up timed apart (`compile_s`; two calls on CUDA: warm
up, then record), never inside a decode timing; inductor's caches live under the cache folder, so a second process
starts faster. `compiles` counts graphs dynamo made, `recompiles` those beyond one per shape.

Guards: each graph (shape × coding) is decode_step under a code object of its own (`_own_step`), so dynamo holds one
graph per function. A graph's first call after its warm-up evaluates its guards (a mismatch recompiles and is
counted); later calls skip them (skip_guard_eval_unsafe), which is safe because a function only ever sees its own
shape. Should its inputs still differ in what guards check, dynamo refuses to run; the step then recompiles, counted
and logged, and checks its guards on every later call.

Owns: the engine registry, buckets, the MAX_CACHES most recently used static caches, the compiled steps and what
compiling cost. Does not know about sampling, stop rules, timing harnesses or manifests.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runner.errors import CacheError, InferenceError
from runner.files import cache_folder
from runner.infer.cache.static.cache import StaticKVCache, make_static_cache
from runner.infer.cache.static.plain import StaticPlainLayer
from runner.infer.compiled import native_step
from runner.infer.compiled.attention import reduced_attention
from runner.infer.compiled.state import StaticDecodeState, decode_step, prefill_pieces, set_writes
from runner.infer.config.architecture import compiled_refusal
from runner.infer.config.eviction import compiled_eviction_reason
from runner.infer.decode.forward import sync
from runner.infer.kernels import cpu_linear
from runner.infer.measure.timing import time_interleaved, time_once
from runner.infer.quant.weights import is_quantized

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_COLUMNS = 256  # length buckets: powers of two from here, capped by the caller's max_seq_len
MAX_CACHES = 3  # static caches an engine keeps (target and draft of a self-drafting model, and one more)


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
    """Point inductor's on-disk caches (FX graphs, kernels) at the cache folder's inductor/ (runner.files.cache_dir)
    unless the user chose. A cache folder that cannot hold them is only a warning: inductor then keeps them in its
    default temporary folder (compiling works, later processes compile again)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_folder("inductor"))
        except CacheError as exc:
            log.warning("%s; inductor keeps its caches in its default temporary folder instead", exc)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True


def input_major_weights(model, repeats: int = 5) -> dict[str, torch.Tensor]:
    """The Linear weights [out,in] that a one-row product reads faster from an input-major copy (same values,
    transposed storage), as views of such copies; the others are left out (functional_call keeps the model's).
    Which layout wins depends on shape, dtype and CPU, so each distinct (shape, dtype) is timed both ways once, with the
    one harness, and the copy kept where its median is ≥ 5 % faster. Costs the copied weights' bytes; a tied
    embedding reads its rows from the same copy. Quantized weights (tensor subclasses, runner.infer.quant.weights) keep
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

    def reading(self) -> tuple[float, int, int]:
        """(seconds, compiles, recompiles) so far: the engine outlives a step, so a step reports the difference of
        two readings, not these running totals."""
        return self.total_s, self.compiles, self.recompiles


class CompiledEngine:
    """One model's compiled decode step and its static caches (one per kind × batch bucket × length bucket).

    A cache is reused by the next state of the same shape: one generation at a time per engine. At most
    `max_caches` are kept (the least recently used goes first, its memory freed once no state holds it), so a
    long bench matrix does not hold one cache per cell; compiled steps stay (a later state of an evicted shape
    allocates a new cache and runs the same graph). `compile=False` runs the same static step eagerly (tests of
    the static path; debugging)."""

    def __init__(self, model, mode: str | None = None, compile: bool = True, max_caches: int = MAX_CACHES,
                 native: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.mode = mode or ("reduce-overhead" if self.cuda else "default")
        self.own_products = not self.cuda and cpu_linear.load()  # few-row products on runner's kernel
        self.weights = None if self.cuda or self.own_products else input_major_weights(model)
        if compile:
            use_compile_cache()
            self.options = compile_options(self.mode, self.own_products)
        else:
            self.mode = "eager"
        self.graphs = self.cuda and self.mode == "reduce-overhead"  # steps replay as CUDA graphs
        # one-column steps in C++ where the model and cache allow (native_step); not when compile=False, which
        # exists to run the compiled graph's own code eagerly
        self.native: native_step.NativeStep | None = None
        if native and compile:
            why_not = native_step.refusal(model)
            if why_not is None:
                self.native = native_step.NativeStep(model)
            else:
                log.info("native step: not for this model (%s): one-column steps run the compiled graph", why_not)
        # (kind, rows, columns, new columns, coding) → its compiled step
        self.steps: dict[tuple, Callable[..., torch.Tensor]] = {}
        self.trusted: set[tuple] = set()  # steps whose guards passed on a real call: later calls skip them
        self.guarded: set[tuple] = set()  # steps that recompiled after being trusted: guards checked on every call
        self.caches: OrderedDict[tuple, StaticKVCache] = OrderedDict()  # least recently used first
        self.max_caches = max_caches
        self.warm: set[tuple] = set()  # (kind, rows, columns, new columns) already compiled
        self.stats = CompileStats()

    @torch.inference_mode()  # every cache's tensors are inference tensors, as the steps were compiled for
    def state(self, kind: str | None, batch: int, columns: int, max_seq_len: int,
              step_lengths: tuple[int, ...] = (1,), slot: str = "", prefill: int = 0) -> StaticDecodeState:
        """A fresh state for `batch` rows needing `columns` columns (prompt + new tokens); feeds of
        `step_lengths` new columns run compiled (compiled now, before any timing), others eagerly; `prefill` > 0:
        a prompt of that many columns is fed in compiled pieces (compiled now too). States live at once only in
        different slots (a model drafting for itself: "target" and "draft")."""
        if reason := compiled_eviction_reason(kind, prefill="compiled" if prefill else "eager"):
            raise ValueError(reason)
        pieces = prefill_pieces(prefill)
        step_lengths = (*step_lengths, *sorted({padded for _, padded in pieces} - set(step_lengths)))
        columns = max(columns, prefill - pieces[-1][0] + pieces[-1][1] if pieces else 0)  # room for the padding
        shape = (batch_bucket(batch), length_bucket(columns, max_seq_len))
        cache = self._cache((kind, *shape, slot))
        # the steps' key: the static layout, which eviction leaves as it is (a kind with eviction runs the steps of
        # its kind without: its cache is compacted between them, never inside one)
        key = (kind.partition("+")[0] if kind else kind, *shape)
        for length in step_lengths:
            if length <= key[2]:
                self._compile(cache, (*key, length))
        return StaticDecodeState(self, key, cache, batch, step_lengths, compiled_prefill=prefill > 0)

    def _cache(self, key: tuple) -> StaticKVCache:
        """The cache of (kind, rows, columns, slot), made if not kept; the least recently used past max_caches
        dropped."""
        if key in self.caches:
            self.caches.move_to_end(key)
            return self.caches[key]
        while len(self.caches) >= self.max_caches:
            self.caches.popitem(last=False)
        cache = make_static_cache(key[0], self.model, *key[1:3])
        if self.graphs:  # CUDA graphs replay on fixed addresses; a new cache of a known shape re-records (no guard)
            for layer in cache.layers:
                assert isinstance(layer, StaticPlainLayer)  # every static cache's layers (make_static_cache)
                for t in layer.tensors():
                    torch._dynamo.mark_static_address(t, guard=False)
        self.caches[key] = cache
        return cache

    @torch.inference_mode()
    def _compile(self, cache: StaticKVCache, key: tuple) -> None:
        """Compile (or load from inductor's cache) the step of this shape: warm-up steps into the last columns,
        which a state's mask hides and a later write overwrites. Timed on its own and logged."""
        if key in self.warm:
            return
        batch, columns, new = cache.batch, cache.length, key[-1]
        if self.native is not None and self.native.serves(cache, new):
            self.stats.compile_s[key] = 0.0  # nothing to compile: `call` runs the native step
            self.warm.add(key)
            return
        ids = torch.zeros(batch, new, dtype=torch.long, device=self.device)
        span = torch.arange(columns - new, columns, device=self.device)
        mask2d = torch.zeros(batch, columns, dtype=torch.long, device=self.device)
        end = torch.tensor(columns, device=self.device)
        before = _graph_count()
        self.stats.compile_s[key] = 0.0
        for coding in (False, True) if new == 1 and cache.codes_columns() else (new != 1,):
            set_writes(cache, self.model, new, coding)  # as `call` will
            step = self._own_step((*key, coding))

            def warm_step(step: Callable[..., torch.Tensor] = step) -> torch.Tensor:  # no aliased inputs
                return step(self.model, cache, ids, torch.zeros_like(ids), span, end, mask2d, self.weights)

            with reduced_attention(self.model):
                for _ in range(2 if self.graphs else 1):  # CUDA graphs: a first call warms up, the second records
                    self.stats.compile_s[key] += time_once(warm_step, sync=lambda: sync(self.device))
        self.stats.compiles += _graph_count() - before
        self.warm.add(key)
        if self.mode != "eager":
            log.info("compile: step for %s × %d rows × %d columns × %d new in %.1f s (mode %s)",
                     key[0] or "model dtype", batch, columns, new, self.stats.compile_s[key], self.mode)

    def _own_step(self, key: tuple) -> Callable[..., torch.Tensor]:
        """The step of `key` (kind, rows, columns, new columns, coding): decode_step compiled under a code object of
        its own, since dynamo keeps its graphs per code object (the module docstring's Guards)."""
        if self.mode == "eager":  # compile=False
            return decode_step
        if key not in self.steps:
            name = f"decode_step_{len(self.steps)}"
            if sys.version_info >= (3, 11):
                code = decode_step.__code__.replace(co_name=name, co_qualname=name)
            else:  # code objects have no co_qualname before Python 3.11
                code = decode_step.__code__.replace(co_name=name)
            function = types.FunctionType(code, decode_step.__globals__, name, decode_step.__defaults__)
            self.steps[key] = torch.compile(function, dynamic=False, options=self.options)
        return self.steps[key]

    def call(self, key: tuple, cache: StaticKVCache, ids, positions, columns, end, mask2d,
             coding: bool = False) -> torch.Tensor:
        """The compiled step of a state's key (kind, rows, columns) → [B,T,V] logits; a graph made here is a
        recompilation, counted and logged. A KIVI cache has two one-column graphs: the usual one, which codes no
        block and keeps no sink (no quantizer in it), and `coding`'s, for the one column in r that completes a
        block or a sink column (StaticKVCache.needs_coding). Guards are evaluated on a graph's first call only
        (the module docstring's Guards)."""
        if not coding and self.native is not None and self.native.serves(cache, ids.shape[1]):
            return self.native(cache, ids, positions, columns, mask2d)
        before = _graph_count()
        coding = coding or ids.shape[1] != 1  # steps of several columns always code
        set_writes(cache, self.model, ids.shape[1], coding)
        key = (*key, ids.shape[1], coding)
        step, args = self._own_step(key), (self.model, cache, ids, positions, columns, end, mask2d, self.weights)
        with reduced_attention(self.model):
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=key in self.trusted):
                    logits = step(*args)
            except RuntimeError as exc:  # a trusted step met inputs its graph was not made for: dynamo refused to
                if key not in self.trusted or "skip_guard_eval_unsafe" not in str(exc):  # recompile, ran nothing
                    raise
                self.trusted.discard(key)
                self.guarded.add(key)  # two graphs now: only its guards can choose between them
                logits = step(*args)  # recompiles: counted below
        if self.graphs:  # a graph's output is overwritten by the next replay: callers may keep logits longer
            logits = logits.clone()
        if key not in self.guarded:
            self.trusted.add(key)
        made = _graph_count() - before
        if made:
            self.stats.compiles += made
            self.stats.recompiles += made
            log.warning("the compiled decode step recompiled (%d graphs) for %s × %d rows × %d columns × %d new",
                        made, cache.kind, cache.batch, cache.length, ids.shape[1])
        return logits


def _graph_count() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


ENGINES_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its engine (engine_for)


def compile_options(mode: str, own_products: bool = False) -> dict:
    """Inductor's options for `mode` ("default", "reduce-overhead", "freezing"), with `emulate_precision_casts`:
    without it inductor drops a float → fp16 → float round trip inside a fused kernel, so a quantizer that rounds
    its scale or minimum to fp16 and then codes against it would code against the unrounded value, and the compiled
    engine would store other KIVI codes than the eager one. Without the wrapper's size and alignment asserts on
    every input and op output: checks of inductor's own bookkeeping, ~0.5 ms of a 10 ms CPU step (SmolLM2, GGUF
    weights, measured against them in one process)."""
    extra: dict[str, object] = {"freezing": True} if mode == "freezing" else torch._inductor.list_mode_options(mode)
    if own_products:  # few-row products on runner's kernel (cpu_linear)
        extra["post_grad_custom_post_pass"] = cpu_linear.OwnProducts()
    return {"emulate_precision_casts": True, "size_asserts": False, "alignment_asserts": False, **extra}


def engine_for(model) -> CompiledEngine:
    """The model's engine, made once per model object: compiled steps and caches outlive one Generator. A model the
    engine cannot serve is refused here, before any kernel is built or step compiled (check_compilable)."""
    if model not in ENGINES_BY_MODEL:
        check_compilable(model)
        check_compiler(next(model.parameters()).device)
        ENGINES_BY_MODEL[model] = CompiledEngine(model)
    return ENGINES_BY_MODEL[model]


def check_compiler(device: torch.device) -> None:
    """InferenceError when inductor has no working C++ compiler for CPU code: said before anything is built, where
    torch would say it inside the first compiled step (InvalidCxxCompiler, after loading and prefill)."""
    if device.type != "cpu":
        return
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        raise InferenceError("the compiled engine needs a working C++ compiler on CPU (inductor builds its kernels "
                             "with one) and torch found none ($CXX, then g++ on PATH): install g++ (apt install g++), "
                             "or set CXX to one, or use engine: eager") from None


def check_compilable(model) -> None:
    """InferenceError when the compiled engine cannot serve this model (every cache kind has a static layout; a
    sliding window it cannot): architecture.compiled_refusal, the decision `run check` takes on a manifest's config."""
    reason = compiled_refusal(model.config)
    if reason is not None:
        raise InferenceError(f"{model.config.model_type}: {reason}")
