"""`engine: llama.cpp`: a llama-cpp-python `Llama` over a GGUF file, fed token ids (runner's tokenizer decides
them, so prompts are the same tokens on every engine), with llama.cpp's own K/V types.

Greedy decoding is argmax over llama.cpp's logits (ties to the lowest id, as torch.argmax), so on the same f32
weights it picks our engines' tokens wherever the two sums of floats agree on the top token. Sampling goes through
llama.cpp's sampler chain (penalties → top-k → typical → top-p → min-p → temperature → draw), seeded: the same
seed gives the same tokens, not the tokens our sampler draws. Timed with the one harness's Stopwatch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runner.errors import ModelError, RunnerError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.llamacpp import (
    GGML_BYTES,
    GGML_NAMES,
    QUANTIZED,
    LlamaCppOptions,
    flash_attention,
    ggml_type,
    kind_name,
    kind_refusal,
    missing,
    quantized_v_problem,
)
from runner.infer.measure.timing import Stopwatch, Tick

log = logging.getLogger(__name__)

DEFAULT_KIND = "fp16"  # llama.cpp's own K/V type when none is named


class LlamaCppMissing(RunnerError):
    """engine: llama.cpp on a machine without the extra (the message names the command that installs it)."""


@dataclass
class LlamaCppStats:
    """One generation: the tokens' reasons to stop and the timings (the same names as the Generator's)."""

    new_tokens: int = 0
    stop_reason: str = "max_new_tokens"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0


class LlamaCppEngine:
    """One llama.cpp context over `gguf` with K and V stored as `kind` (fp32, fp16, bf16, q8_0, q4_0, q4_1)."""

    def __init__(self, gguf: Path, *, kind: str | None = None, n_ctx: int = 2048,
                 options: LlamaCppOptions | None = None, seed: int = 0, logits_all: bool = False):
        if reason := missing():
            raise LlamaCppMissing(reason)
        kind = kind or DEFAULT_KIND
        if reason := kind_refusal(kind) or quantized_v_problem(kind, options):
            raise ModelError(f"engine: llama.cpp: {reason}")
        import llama_cpp

        options = options or LlamaCppOptions()
        threads = options.threads or os.cpu_count() or 1
        self.kind, self.gguf, self.options = kind_name(kind), Path(gguf), options
        self.flash_attn = flash_attention(kind, options.flash_attn)
        self._llama_cpp = llama_cpp
        try:
            self.llama = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=n_ctx, n_batch=options.batch, n_ubatch=options.batch,
                n_threads=threads, n_threads_batch=threads, flash_attn=self.flash_attn, type_k=ggml_type(kind),
                type_v=ggml_type(kind), logits_all=logits_all, seed=seed, last_n_tokens_size=n_ctx, verbose=False)
        except (ValueError, RuntimeError) as exc:
            hint = (" (a block type needs a head size that its block of 32 divides)" if self.kind in QUANTIZED
                    else "")
            raise ModelError(f"engine: llama.cpp could not load {gguf} with K/V {GGML_NAMES[self.kind]}: {exc}"
                             f"{hint}") from None
        self.n_vocab = self.llama.n_vocab()
        self.n_ctx = n_ctx

    def describe(self) -> dict:
        return {"engine": "llama.cpp", "gguf": str(self.gguf), "type_k": GGML_NAMES[self.kind],
                "type_v": GGML_NAMES[self.kind], "flash_attn": self.flash_attn,
                "threads": self.llama.n_threads if hasattr(self.llama, "n_threads") else self.options.threads,
                "batch": self.options.batch}

    def kv_bytes(self, tokens: int) -> int:
        """Bytes K and V take for `tokens` tokens at this context's type (from the GGUF's shape: every layer, every
        KV head; a block type at its bytes per 32 elements)."""
        meta = self.llama.metadata
        arch = meta.get("general.architecture", "llama")
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        key_len = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
        value_len = int(meta.get(f"{arch}.attention.value_length", key_len))
        per_token = int(meta[f"{arch}.block_count"]) * kv_heads * (key_len + value_len)
        return int(per_token * tokens * GGML_BYTES[self.kind])

    # the forward chain ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (llama.cpp drops the cache's cells past n_tokens at the next eval)."""
        self.llama.reset()

    def feed(self, ids: list[int]) -> np.ndarray:
        """Evaluate `ids` after what is cached; → the last position's logits (float32, [vocab])."""
        if self.llama.n_tokens + len(ids) > self.n_ctx:
            raise ModelError(f"engine: llama.cpp: {self.llama.n_tokens + len(ids)} tokens exceed its context of "
                             f"{self.n_ctx} (max_seq_len)")
        self.llama.eval(ids)
        pointer = self._llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def logits(self, ids: list[int]) -> np.ndarray:
        """Every position's logits [len(ids), vocab] of `ids` from an empty cache (a context made with
        logits_all=True), fed in pieces of `batch` tokens through the cache."""
        if not self.llama._logits_all:
            raise ValueError("LlamaCppEngine.logits needs logits_all=True")
        self.reset()
        self.llama.eval(ids)
        return np.array(self.llama.scores[: len(ids), :], dtype=np.float32)

    # decoding ---------------------------------------------------------------------------------------------------
    def greedy(self, prompt: list[int], steps: int, tick: Tick = lambda: None,
               eos: frozenset[int] = frozenset()) -> list[int]:
        """Up to `steps` greedy tokens after `prompt` from an empty cache, `tick()` at each (the timing harness's
        run_once); stops after an `eos` token."""
        self.reset()
        out: list[int] = []
        logits = self.feed(prompt)
        while True:
            token = int(np.argmax(logits))
            out.append(token)
            tick()
            if len(out) == steps or token in eos:
                return out
            logits = self.feed([token])

    def timed_greedy(self, prompt: list[int], steps: int):
        """The timing harness's run_once: `steps` greedy tokens after `prompt`, EOS ignored, a tick at each."""

        def run_once(tick: Tick) -> None:
            self.greedy(prompt, steps, tick)

        return run_once

    def generate(self, prompt: list[int], config: GenerateConfig, eos: frozenset[int] = frozenset(),
                 on_token=None) -> LlamaCppStats:
        """Greedy (config.temperature 0) or llama.cpp's sampler; `on_token(token)` as each is decided (its true
        ends the generation: a stop string)."""
        stats = LlamaCppStats()
        sampler = None if config.greedy else self._sampler(config, prompt)
        watch = Stopwatch()
        self.reset()
        logits = self.feed(prompt)
        try:
            while True:
                token = int(np.argmax(logits)) if sampler is None else int(self._sample(sampler))
                if not stats.tokens:
                    stats.prefill_s = watch.lap()
                stats.tokens.append(token)
                if token in eos:
                    stats.stop_reason = "eos"
                    break
                if on_token is not None and on_token(token):
                    stats.stop_reason = "stop_string"
                    break
                if len(stats.tokens) == config.max_new_tokens:
                    stats.stop_reason = "max_new_tokens"
                    break
                logits = self.feed([token])
        finally:
            self.llama._sampler = None
        stats.decode_s = watch.lap()
        stats.new_tokens = len(stats.tokens)
        return stats

    def _sampler(self, config: GenerateConfig, prompt: list[int]):
        """llama.cpp's sampler chain for the config's filters (unset = off), seeded, the prompt's tokens accepted
        so the repetition penalty sees the whole sequence (as ours does)."""
        seed = config.seed if config.seed is not None else 0
        self.llama.set_seed(seed % 2**32)
        sampler = self.llama._init_sampler(
            top_k=config.top_k or 0, top_p=config.top_p or 1.0, min_p=config.min_p or 0.0,
            typical_p=config.typical_p or 1.0, temp=config.temperature, repeat_penalty=config.repetition_penalty)
        for token in prompt:
            self._llama_cpp.llama_sampler_accept(sampler.sampler, token)
        self.llama._sampler = sampler
        return sampler

    def _sample(self, sampler) -> int:
        return sampler.sample(self.llama._ctx, -1)
