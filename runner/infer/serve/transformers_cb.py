"""transformers' own continuous batching as a baseline: the same requests, released at their scheduled arrivals into
its `ContinuousBatchingManager` (paged KV cache, its FIFO scheduler, chunked prefill), every token timed as it comes.

The manager runs its own generation loop in a background thread; `TransformersServer` is driven from the caller's
thread by runner.infer.serve.driver.drive like every server: `submit` releases a request at its `arrival_s`, `step`
reads the manager's per-token stream. A token's time is transformers' own stamp of when it was sampled
(`record_timestamps`, on time.perf_counter) moved onto the load clock, so both lie on one timeline; on a clock that
is not time.perf_counter shifted (a test's fake) it is when the server saw it.
`scheduled_s` is when transformers first took the request out of its waiting queue (its `lifespan[0]`), known only on
time.perf_counter (None otherwise). A preemption is a soft reset (transformers drops the request's blocks and
re-prefills prompt + output later): seen as a new `created_time` on the request's stream. Prefix-cache hits are not
exposed by transformers: `cached_prompt_tokens` stays 0.

Exact output lengths: transformers' CB has no `min_new_tokens` (its MinNewTokens processor is not CB-capable), so a
request whose EOS must be ignored for a while is sent with no EOS at all and cancelled by the driver at the first EOS
it is allowed to stop at (the token after it, if already computed, is dropped; at most one step of extra work).
A request that asks for exactly `max_new_tokens` (min = max, synthetic loads) is sent with no EOS: it runs to length.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runner.infer.config.kinds import DTYPES, canonical_kind
from runner.infer.serve.driver import drive, load_clock
from runner.infer.serve.load import Load
from runner.infer.serve.requests import Request, RequestRecord

log = logging.getLogger(__name__)

FLOAT_KINDS = {kind: dtype for dtype, kind in DTYPES.items()}  # fp32 → "float32": the kinds its paged cache can be
POLL_S = 0.05  # longest wait on the output stream before the driver checks arrivals and the manager's thread again
DEFAULT_MAX_BATCH_TOKENS = 2048  # per-step token budget; transformers' 8192 makes its dense CPU mask 16× larger
NO_EOS = -1  # transformers skips negative EOS ids: a request sent with it runs to max_new_tokens
CB_ATTENTION = ("sdpa", "eager", "paged|eager")  # or any flash_attention_*


def transformers_cb_reason(model: Any, cache_kind: str | None = None) -> str:
    """Why transformers' continuous batching cannot serve `model` with `cache_kind` ("" when it can): a transformers
    without it, a model that is not a transformers PreTrainedModel with its mixin, an attention implementation it
    refuses, or a cache kind its paged cache cannot hold (it stores K/V in the model's own dtype, nothing else)."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError:
        import transformers

        return f"transformers {transformers.__version__} has no continuous batching (ContinuousBatchingManager)"
    hf = _hf_model(model)
    if not callable(getattr(hf, "init_continuous_batching", None)):
        return f"{type(hf).__name__} is not a transformers model with continuous batching (init_continuous_batching)"
    attention = getattr(hf.config, "_attn_implementation", None) or "eager"
    if attention not in CB_ATTENTION and not attention.startswith("flash_attention"):
        return f"its attention implementation {attention!r} is not one continuous batching runs (sdpa, eager, flash)"
    return _cache_kind_reason(cache_kind, _dtype_name(hf))


def _cache_kind_reason(cache_kind: str | None, model_dtype: str) -> str:
    if cache_kind is None or cache_kind == "auto":
        return ""
    kind = canonical_kind(cache_kind)
    if kind not in FLOAT_KINDS:
        return (f"cache kind {kind} is quantized: transformers' paged cache stores K/V in the model's dtype "
                f"({model_dtype}) only")
    if FLOAT_KINDS[kind] != model_dtype:
        return (f"cache kind {kind} stores {FLOAT_KINDS[kind]}: transformers' paged cache stores K/V in the model's "
                f"dtype ({model_dtype}) only")
    return ""


def kv_blocks_for_budget(model: Any, kv_budget_mb: float, block_size: int) -> int:
    """How many whole-model blocks of `block_size` tokens (K and V of every layer, the model's dtype) fit the
    budget: transformers' `num_blocks`. Its mask and activation buffers come on top, as in our scheduler."""
    config = _hf_model(model).config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_bytes = torch.empty((), dtype=_hf_model(model).dtype).element_size()
    block_bytes = 2 * config.num_hidden_layers * heads * head_dim * block_size * element_bytes
    return int(kv_budget_mb * 2**20 // block_bytes)


@dataclass(frozen=True)
class CbSettings:
    """How transformers' manager is set up: the same limits our scheduler is given, in its own words."""

    max_batch_size: int  # max_requests_per_batch
    block_size: int = 32  # page_size: tokens per block (at least 4)
    num_blocks: int = 0  # KV capacity in blocks of block_size tokens
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # tokens per forward (chunked prefill)
    prefix_caching: bool = False  # allow_block_sharing
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos_ids: frozenset[int] = frozenset()

    def generation_config(self) -> Any:
        from transformers import GenerationConfig

        sampling = self.temperature > 0
        return GenerationConfig(do_sample=sampling, temperature=self.temperature if sampling else None,
                                top_k=self.top_k if sampling else None, top_p=self.top_p if sampling else None,
                                eos_token_id=NO_EOS, max_new_tokens=1)

    def cb_config(self) -> Any:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        return ContinuousBatchingConfig(page_size=self.block_size, num_blocks=self.num_blocks,
                                        max_batch_tokens=self.max_batch_tokens,
                                        max_requests_per_batch=self.max_batch_size,
                                        allow_block_sharing=self.prefix_caching, seed=self.seed)


def serve_with_transformers(model: Any, requests: Sequence[Request] | Load, *, warmup: Sequence[Request] | Load = (),
                            clock: Callable[[], float] | None = None, sleep: Callable[[float], None] = time.sleep,
                            **settings: Any) -> list[RequestRecord]:
    """Serve `requests` (or a Load, follow-ups included) with transformers' continuous batching → one record per
    request, in id order; `settings` as TransformersServer's. `warmup` is served first on the same manager, its
    records dropped; the load's clock starts after it (a given `clock` is used as it is, for both)."""
    server = TransformersServer(model, **{"perf_stamps": clock is None, **settings})
    try:
        if warmup:
            drive(server, warmup, clock or load_clock(), sleep)
        return drive(server, requests, clock or load_clock(), sleep)
    finally:
        server.close()


@dataclass
class _Live:
    """A request sent to the manager and not finished yet, as the server follows it."""

    request: Request
    record: RequestRecord
    stop_at_eos_from: int | None  # first output index an EOS ends it at (the server cancels it there)
    eos_sent: bool  # transformers itself stops it at an EOS
    created_s: float | None = None  # transformers' created_time of the state it streams from (a soft reset renews it)


class TransformersServer:
    """transformers' manager as a Server for runner.infer.serve.driver.drive: `submit` releases a request into it,
    `step` reads its stream for up to POLL_S, `busy` while any request is in flight. KV memory is `num_blocks`
    blocks or what `kv_budget_mb` holds. `perf_stamps`: the driver's clock is time.perf_counter shifted (a load
    clock), so transformers' own per-token stamps are used; else a token's time is when the server saw it."""

    def __init__(self, model: Any, *, max_batch_size: int, block_size: int = 32, num_blocks: int | None = None,
                 kv_budget_mb: float | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 prefix_caching: bool = False, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, eos_token_id: int | Iterable[int] | None = None,
                 perf_stamps: bool = True):
        if (num_blocks is None) == (kv_budget_mb is None):
            raise ValueError("give num_blocks or kv_budget_mb, not both")
        hf = _hf_model(model)
        reason = transformers_cb_reason(hf)
        if reason:
            raise ValueError(f"transformers' continuous batching cannot serve this model: {reason}")
        blocks = num_blocks if num_blocks is not None else kv_blocks_for_budget(hf, kv_budget_mb or 0.0, block_size)
        self.settings = CbSettings(max_batch_size=max_batch_size, block_size=block_size, num_blocks=blocks,
                                   max_batch_tokens=max_batch_tokens, prefix_caching=prefix_caching,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                   eos_ids=_eos_ids(hf, eos_token_id))
        self.manager = hf.init_continuous_batching(generation_config=self.settings.generation_config(),
                                                   continuous_batching_config=self.settings.cb_config())
        with torch.inference_mode():
            self.manager.start()
        self.perf_stamps = perf_stamps
        self.clock: Callable[[], float] = time.perf_counter  # drive sets the load's
        self.live: dict[str, _Live] = {}
        self.dead = ""
        self._sent = 0  # keys stay unique across loads served on one manager (warm-up, then the load)

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def submit(self, request: Request) -> RequestRecord:
        record = RequestRecord(id=request.id, arrival_s=request.arrival_s, prompt_tokens=len(request.prompt_ids))
        problem = self.dead or self._does_not_fit(request)
        if problem:
            return self._finish(record, "error", problem)
        native, stop_from = self._eos_rule(request)
        key = f"{self._sent}:{request.id}"
        self._sent += 1
        sent = self.manager.add_request(list(request.prompt_ids), request_id=key,
                                        max_new_tokens=request.max_new_tokens, streaming=True,
                                        record_timestamps=True, eos_token_id=native)
        if sent is None:
            return self._finish(record, "error", "transformers' manager refused the request (it is stopping)")
        self.live[key] = _Live(request, record, stop_from, eos_sent=native != NO_EOS)
        return record

    def step(self) -> None:
        """Wait up to POLL_S for the next streamed output and take it; a manager that died fails what is in flight."""
        output = self.manager.get_result(timeout=POLL_S)
        if output is not None:
            self._take(output)
        elif not self.manager.is_running():
            self.dead = f"transformers' generation loop stopped: {self._fatal_error()}"
            for key in list(self.live):
                self._finish(self.live.pop(key).record, "error", self.dead)

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)
        self.manager.destroy()

    def _load_s(self, perf_s: float) -> float:
        """A time.perf_counter stamp of transformers' on the load clock."""
        return perf_s - (time.perf_counter() - self.clock())

    def _does_not_fit(self, request: Request) -> str:
        """A request that needs more KV blocks than the whole cache would stop transformers' loop for everyone."""
        tokens = len(request.prompt_ids) + request.max_new_tokens
        blocks = math.ceil(tokens / self.settings.block_size)
        if blocks > self.settings.num_blocks:
            return (f"needs {blocks} KV blocks ({tokens} tokens); transformers' paged cache has "
                    f"{self.settings.num_blocks} of {self.settings.block_size} tokens")
        return ""

    def _eos_rule(self, request: Request) -> tuple[int | list[int], int | None]:
        """(EOS ids transformers stops at, first output index the server stops at an EOS): see the module doc."""
        eos = self.settings.eos_ids
        if not eos or request.min_new_tokens >= request.max_new_tokens:
            return NO_EOS, None
        if request.min_new_tokens <= 1:
            return sorted(eos), None
        return NO_EOS, request.min_new_tokens - 1

    def _take(self, output: Any) -> None:
        """One streamed output: the request's tokens so far; record the new ones and finish it when it ended."""
        live = self.live.get(output.request_id)
        if live is None:  # a request the server already finished (cancelled at EOS)
            return
        seen_s, record = self.clock(), live.record
        if output.error is not None or output.status.name == "FAILED":
            self._finish(self.live.pop(output.request_id).record, "error", str(output.error))
            return
        self._note_start(live, output)
        stamps = output.timestamps or []
        for index in range(len(record.output_ids), len(output.generated_tokens)):
            token = int(output.generated_tokens[index])
            record.output_ids.append(token)
            record.token_s.append(self._load_s(stamps[index]) if self.perf_stamps and index < len(stamps)
                                  else seen_s)
            if live.stop_at_eos_from is not None and index >= live.stop_at_eos_from and token in self.settings.eos_ids:
                self.manager.cancel_request(output.request_id)
                self._finish(self.live.pop(output.request_id).record, "eos")
                return
        if output.is_finished():
            ended_by_eos = live.eos_sent and bool(record.output_ids) and record.output_ids[-1] in self.settings.eos_ids
            self._finish(self.live.pop(output.request_id).record, "eos" if ended_by_eos else "length")

    def _note_start(self, live: _Live, output: Any) -> None:
        """Scheduled time (first admission) and soft resets (a renewed created_time: its KV was dropped)."""
        created = float(output.created_time)
        if live.created_s is not None and created != live.created_s:
            live.record.preemptions += 1
        live.created_s = created
        started = float(output.lifespan[0])
        if live.record.scheduled_s is None and self.perf_stamps and started > 0:
            live.record.scheduled_s = self._load_s(started)

    def _finish(self, record: RequestRecord, finish: str, error: str = "") -> RequestRecord:
        record.finish, record.error = finish, error
        if error:
            log.warning("request %d: %s", record.id, error)
        return record

    def _fatal_error(self) -> str:
        error = getattr(getattr(self.manager, "background_thread_status", None), "fatal_error", None)
        return str(error) if error is not None else "no error was recorded"


def _hf_model(model: Any) -> Any:
    """The transformers model itself, also when given runner's LoadedModel (which holds it as `.model`)."""
    if hasattr(model, "init_continuous_batching") or not hasattr(model, "tokenizer"):
        return model
    return model.model


def _dtype_name(hf: Any) -> str:
    return str(getattr(hf, "dtype", torch.float32)).removeprefix("torch.")


def _eos_ids(hf: Any, configured: int | Iterable[int] | None) -> frozenset[int]:
    """The ids that end a request: `configured` if given, else the model's generation config's, else its config's."""
    eos = configured
    if eos is None:
        eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(hf.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(e) for e in ([eos] if isinstance(eos, int) else eos) if int(e) >= 0)
