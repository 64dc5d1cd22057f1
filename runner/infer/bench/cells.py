"""One bench cell: a model, a batch of equal-length prompts, a token count and a cache kind, timed three ways.

    measure_ours         our prefill + greedy decode chain (runner.infer.select.speed), a tick per token; with
                         engine="compiled" the compiled engine's static state (compiled before the timing)
    measure_hf           transformers' own model.generate() on the same model, inputs and cache kind
    measure_hf_compiled  transformers' static cache + its compiled forward (cache_implementation="static"), the
                         fastest thing a transformers user sets up; the model's dtype only; compile timed apart
    measure_speculative  our SpeculativeGenerator (greedy), whole-generation time only; a batch runs its rounds
                         together (batched=False: rows one after another, today's baseline)
    measure_hf_assisted  transformers' assisted generation (draft model or prompt lookup), the same way; batch 1
                         only (ASSISTED_NA says why)

Every side takes the model, the prompt ids and one `Cell` (what the sides of a cell share: tokens to make, cache
kind, repeats, warmup, our engine, the copy bandwidth); the speculative sides also one `Speculation` (the draft and
its settings). Greedy with EOS ignored, so every repeat of every side makes exactly `new_tokens` tokens. Each side
returns a flat dict of figures (medians, p90s, spreads, peak memory, measured KV bytes, the fraction
of the copy-bandwidth bound reached while decoding). Does not know about manifests or tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.infer.cache.layers import cache_bytes
from runner.infer.cache.registry import make_cache
from runner.infer.compiled.engine import engine_for
from runner.infer.config.decoding import SpeculativeConfig
from runner.infer.config.kinds import DTYPES
from runner.infer.decode.sampling import greedy_tokens
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.measure.timing import PeakMemory, Summary, TokenTiming, on_device, time_once, time_ticks
from runner.infer.quant.weights import is_quantized, tensor_bytes, weight_bytes
from runner.infer.select.speed import greedy_prefill, greedy_steps
from runner.infer.speculative.generator import SpeculativeGenerator

MIB = 2**20
ASSISTED_NA = ("n/a above batch 1: transformers' assisted generation takes batch size 1 "
               "(transformers issue #32165, batched assisted generation, is open)")


@dataclass(frozen=True)
class Cell:
    """What every side of a bench cell shares, besides the model and the prompt ids."""

    new_tokens: int  # tokens each repeat makes (EOS ignored)
    kind: str | None  # the cache kind (None: the model's own dtype)
    repeats: int  # timed repeats
    warmup: int  # untimed repeats before them
    engine: str = "eager"  # ours: eager or compiled (the baselines are transformers' own)
    bandwidth: float | None = None  # copy bandwidth (bytes/s): the roofline fraction `bw_fraction`, when given


@dataclass(frozen=True)
class Speculation:
    """The speculative sides' draft: a draft model or "prompt-lookup", k, and for a draft with another tokenizer
    both tokenizers (then proposals go through text)."""

    draft: object  # a draft model, or the string "prompt-lookup"
    spec_k: int
    adaptive: bool = False  # ours: adaptive k
    batched: bool = True  # ours: a batch runs its rounds together (False: rows one after another)
    tokenizer: object = None  # the target's, with draft_tokenizer: a draft with another tokenizer
    draft_tokenizer: object = None


def measure_ours(model, ids: torch.Tensor, cell: Cell) -> dict:
    """ids [B,P] (no padding) → figures of our decode chain (engine eager or compiled)."""
    if cell.engine == "compiled":
        return _measure_compiled(model, ids, cell)
    last: dict = {}

    @torch.inference_mode()
    def run_once(tick: Callable[[], None]) -> None:
        cache, token, mask = greedy_prefill(model, ids, cell.kind)
        tick()
        greedy_steps(model, cache, token, mask, cell.new_tokens - 1, tick)
        last["cache"] = cache

    return _measure(model, ids, cell, run_once, last)


def _measure_compiled(model, ids: torch.Tensor, cell: Cell) -> dict:
    """The compiled engine on the cell: prefill into a static state, then compiled one-token greedy steps."""
    new_tokens, kind = cell.new_tokens, cell.kind
    engine, columns = engine_for(model), ids.shape[1] + new_tokens
    seconds, _, recompiles = engine.stats.reading()
    engine.state(kind, ids.shape[0], columns, columns)  # compiles this shape now, outside the timing
    compile_s = engine.stats.total_s - seconds
    live = torch.ones_like(ids[:, 0])
    last: dict[str, object] = {}

    @torch.inference_mode()
    def run_once(tick: Callable[[], None]) -> None:
        state = engine.state(kind, ids.shape[0], columns, columns)
        logits, _ = state.prefill(model, ids, torch.ones_like(ids))
        token = greedy_tokens(logits)
        tick()
        for _ in range(new_tokens - 1):
            token = greedy_tokens(state.feed(model, token, live))
            tick()
        last["cache"], last["state"] = state.cache, state

    figures = _measure(model, ids, cell, run_once, last)
    return {**figures, "compile_s": compile_s, "recompiles": engine.stats.recompiles - recompiles}


def measure_hf(model, ids: torch.Tensor, cell: Cell, compiled: bool = False) -> dict:
    """The same cell through transformers' model.generate(); a streamer ticks per token. `compiled`: through
    transformers' own static cache and compiled forward (see measure_hf_compiled)."""
    from transformers import CompileConfig
    from transformers.generation.streamers import BaseStreamer

    new_tokens, kind = cell.new_tokens, cell.kind
    last: dict = {}
    extra: dict = {}
    if compiled:
        if kind is not None and kind != DTYPES[str(model.dtype).removeprefix("torch.")]:
            raise ValueError(f"hf-compiled uses transformers' static cache in the model's dtype; not {kind}")
        config = CompileConfig(dynamic=False, fullgraph=False, mode="default")
        # transformers compiles on its own only on accelerators; it declares this private flag as a bare None
        config._compile_all_devices = True  # type: ignore[assignment]
        extra = {"cache_implementation": "static", "compile_config": config}

    class TickStreamer(BaseStreamer):
        def __init__(self, tick):
            self.tick, self.prompt_seen = tick, False

        def put(self, value):
            if self.prompt_seen:  # generate() puts the prompt first, then each new token
                self.tick()
            self.prompt_seen = True

        def end(self):
            pass

    def run_once(tick: Callable[[], None]) -> None:
        cache = None if compiled else make_cache(kind, model)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, cache=cache,
                             streamer=TickStreamer(tick), pad_token_id=0, return_dict_in_generate=True, **extra)
        last["cache"] = out.cache

    if not compiled:
        return _measure(model, ids, cell, run_once, last)
    compile_s = time_once(lambda: run_once(lambda: None), **on_device(ids.device))  # the first call compiles
    return {**_measure(model, ids, cell, run_once, last), "compile_s": compile_s}


def measure_hf_compiled(model, ids: torch.Tensor, cell: Cell) -> dict:
    """The cell through transformers' StaticCache and compiled forward; `compile_s` = its first call (compile
    included), timed apart."""
    return measure_hf(model, ids, cell, compiled=True)


def measure_speculative(model, ids: torch.Tensor, cell: Cell, speculation: Speculation) -> dict:
    """Greedy speculative decoding of the cell: tokens/s, acceptance (overall and the lowest / highest row's) and
    whether the rounds ran batched (False at batch 1, for KIVI kinds, the compiled engine, or when asked)."""
    spec_k, new_tokens = speculation.spec_k, cell.new_tokens
    config = SpeculativeConfig(spec_k=spec_k, spec_k_adaptive=speculation.adaptive, max_new_tokens=new_tokens,
                               temperature=0.0, cache_kind=cell.kind,
                               max_seq_len=ids.shape[1] + new_tokens + 2 * spec_k + 2, engine=cell.engine)
    gen = SpeculativeGenerator(target_model=model, draft_model=speculation.draft, config=config,
                               batched=speculation.batched, tokenizer=speculation.tokenizer,
                               draft_tokenizer=speculation.draft_tokenizer)
    figures = _measure_whole(lambda: gen.generate(ids), ids, cell, lambda: sum(gen.stats.new_tokens))
    rows = gen.stats.row_acceptance
    return {**figures, "acceptance": gen.stats.acceptance_rate, "acceptance_row_min": min(rows),
            "acceptance_row_max": max(rows), "batched": gen.stats.batched,
            "target_forwards": gen.stats.target_forwards}


def measure_hf_assisted(model, ids: torch.Tensor, cell: Cell, speculation: Speculation) -> dict:
    """transformers' assisted generation on the same cell: the draft model, or prompt lookup with k tokens; with
    both tokenizers given, its universal assisted generation (a draft with another tokenizer)."""
    if ids.shape[0] != 1:
        raise ValueError(ASSISTED_NA)
    draft, spec_k, new_tokens = speculation.draft, speculation.spec_k, cell.new_tokens
    drafting = {"prompt_lookup_num_tokens": spec_k} if isinstance(draft, str) else {
        "assistant_model": draft, "num_assistant_tokens": spec_k}
    if speculation.draft_tokenizer is not None and not isinstance(draft, str):
        drafting |= {"tokenizer": speculation.tokenizer, "assistant_tokenizer": speculation.draft_tokenizer}
    produced = {}

    def run_once() -> None:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             cache=make_cache(cell.kind, model), pad_token_id=0, **drafting)
        produced["tokens"] = out.shape[1] - ids.shape[1]

    return _measure_whole(run_once, ids, cell, lambda: produced["tokens"])


def _measure_whole(run_once: Callable[[], object], ids: torch.Tensor, cell: Cell, tokens: Callable[[], int]) -> dict:
    """Whole-generation time only (speculative rounds make several tokens at once: no per-token ticks)."""
    def run_then_tick(tick: Callable[[], None]) -> None:
        run_once()
        tick()

    with PeakMemory(ids.device) as peak:
        marks = time_ticks(run_then_tick, cell.repeats, cell.warmup, **on_device(ids.device))
    seconds = Summary.of([m[-1] for m in marks])
    rates = Summary.of([tokens() / m[-1] for m in marks])  # greedy: the same tokens every repeat
    return {"tokens_per_s": rates.median, "tokens_per_s_spread": rates.spread, "total_ms": seconds.median * 1e3,
            "total_ms_p90": seconds.p90 * 1e3, "peak_mib": peak.bytes / MIB}


def measure_llamacpp(engine: LlamaCppEngine, ids: torch.Tensor, cell: Cell) -> dict:
    """The cell through llama.cpp: one sequence (a batch above 1 is a ValueError: llama-cpp-python decodes one),
    greedy, `new_tokens` tokens, EOS ignored; KV bytes are llama.cpp's type at the cell's length."""
    if ids.shape[0] != 1:
        raise ValueError("engine llama.cpp decodes one sequence: batch 1 only")
    prompt = ids[0].tolist()
    with PeakMemory(torch.device("cpu")) as peak:
        marks = time_ticks(engine.timed_greedy(prompt, cell.new_tokens), cell.repeats, cell.warmup)
    return {**_timing_figures(TokenTiming.of(marks, 1)), "peak_mib": peak.bytes / MIB,
            "kv_mib": engine.kv_bytes(len(prompt) + cell.new_tokens) / MIB}


def _measure(model, ids: torch.Tensor, cell: Cell, run_once: Callable[[Callable[[], None]], None], last: dict) -> dict:
    with PeakMemory(ids.device) as peak:
        marks = time_ticks(run_once, cell.repeats, cell.warmup, **on_device(ids.device))
    timing = TokenTiming.of(marks, ids.shape[0])
    # the bytes of the tokens held at the end, on either engine (an evicting kind: its kept prompt and the tokens
    # generated since, as estimate_cache_bytes says); the compiled engine's preallocated buffer is apart
    state = last.get("state")
    kv = state.held_bytes() if state is not None else cache_bytes(last["cache"])
    buffer = {} if state is None else {"kv_buffer_mib": cache_bytes(last["cache"]) / MIB}
    figures = {**_timing_figures(timing), "peak_mib": peak.bytes / MIB, "kv_mib": kv / MIB, **buffer}
    if cell.bandwidth:
        figures["bw_fraction"] = bandwidth_fraction(model, kv, ids.shape[1], cell.new_tokens, timing.itl_s.median,
                                                    cell.bandwidth)
    return figures


def _timing_figures(timing: TokenTiming) -> dict:
    """A cell's latencies and throughputs: medians, p90s and spreads, on any engine."""
    return {"ttft_ms": timing.ttft_s.median * 1e3, "ttft_ms_p90": timing.ttft_s.p90 * 1e3,
            "ttft_ms_spread": timing.ttft_s.spread * 1e3,
            "itl_ms": timing.itl_s.median * 1e3, "itl_ms_p90": timing.itl_s.p90 * 1e3,
            "itl_ms_spread": timing.itl_s.spread * 1e3,
            "decode_tokens_per_s": timing.decode_tokens_per_s.median,
            "decode_tokens_per_s_spread": timing.decode_tokens_per_s.spread,
            "tokens_per_s": timing.tokens_per_s.median, "tokens_per_s_spread": timing.tokens_per_s.spread}


def step_weight_bytes(model) -> int:
    """Weight bytes a decode step reads, measured (quantized weights count their codes and scales): all of them but
    an untied input embedding table, of which a step reads only its batch's rows."""
    weights = weight_bytes(model)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    plain = head is not None and not is_quantized(head.weight) and not is_quantized(embedding)
    tied = head is not None and (head.weight is embedding or plain and head.weight.data_ptr() == embedding.data_ptr())
    return weights if tied else weights - tensor_bytes(embedding)


def bandwidth_fraction(model, kv_bytes_end: int, prompt_len: int, new_tokens: int, step_s: float,
                       bandwidth: float) -> float:
    """Achieved fraction of the memory-bandwidth bound while decoding: every step reads its weights
    (step_weight_bytes) and the cache as it stands at mid-decode (measured bytes at the end, scaled by length)."""
    if not step_s or step_s <= 0 or math.isnan(step_s):
        return math.nan
    weights = step_weight_bytes(model)
    kv_mid = kv_bytes_end * (prompt_len + new_tokens / 2) / (prompt_len + new_tokens)
    return (weights + kv_mid) / step_s / bandwidth

