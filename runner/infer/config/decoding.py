"""GenerateConfig: the decoding settings, with the seed guide's names verbatim.

Inert: validators check and normalise values, they never touch torch, devices or disk, so the
manifest schema can reuse this class without importing torch.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runner.errors import ValueAt
from runner.infer.config.eviction import compiled_eviction_reason, speculative_eviction_reason
from runner.infer.config.kinds import DEFAULT_CANDIDATES, checked_kind, seq_len_problem
from runner.infer.config.llamacpp import LlamaCppOptions, kind_refusal, quantized_v_problem
from runner.infer.config.quantization import check_quantizations
from runner.infer.config.tasks import TaskGates

Engine = Literal["eager", "compiled", "llama.cpp"]  # decode engines (see ENGINE_DESCRIPTION)
ENGINES: tuple[Engine, ...] = get_args(Engine)
TorchEngine = Literal["eager", "compiled"]  # ours, on the torch model (prefill, speculative decoding)


class AutoCacheConfig(BaseModel):
    """How `cache_kind: auto` chooses: budget filter → quality gates → speed pick → persisted plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_candidates: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CANDIDATES), min_length=1,
        description="Kinds to consider (kivi options allowed, e.g. kivi4:g32:r128), in order of preference.")
    cache_budget_mb: float | None = Field(None, gt=0, description=(
        "Most MiB the cache may take at max_seq_len × batch (estimated); unset = no limit."))
    cache_quality_max_delta_nll: float = Field(0.05, ge=0, description=(
        "Most mean NLL increase (nats/token) of teacher-forced tokens decoded through the cache."))
    cache_quality_max_ppl_ratio: float = Field(1.05, ge=1.0, description=(
        "Most perplexity ratio candidate / reference over cache_quality_ppl_len tokens."))
    cache_quality_max_mean_kl: float = Field(0.1, ge=0, description=(
        "Most mean KL(reference ‖ candidate) of next-token distributions (decode steps and needle answer), nats."))
    cache_quality_prompt_len: int = Field(64, ge=1, le=1_000_000, description=(
        "Tokens prefilled before the teacher-forced decode steps."))
    cache_quality_decode_steps: int = Field(4, ge=1, le=10_000, description="Teacher-forced decode steps per window.")
    cache_quality_windows: int = Field(8, ge=1, le=1024, description=(
        "Text windows (a batch) the NLL and KL average over."))
    cache_quality_ppl_len: int = Field(512, ge=2, le=1_000_000, description=(
        "Tokens in the perplexity window and the needle probe (capped by max_seq_len)."))
    cache_quality_data: str = Field("pydoc", min_length=1, json_schema_extra={"input_file": "text"}, description=(
        "Evaluation text: pydoc, shakespeare, britannica, a .txt file (relative to the manifest) or "
        "hf:OWNER/REPO/PATH."))
    cache_quality_on_fail: Literal["error", "reference"] = Field("reference", description=(
        "When no candidate passes the gates: fail the step, or use the reference kind (recorded as gate_failed)."))
    cache_auto_benchmark: bool = Field(True, description=(
        "Time the survivors and pick the fastest median (only when faster beyond the spread measured); off = the "
        "first survivor."))
    cache_auto_tie_break: Literal["quality", "bytes"] = Field("quality", description=(
        "Among survivors whose speeds differ by less than their measured spread: the lowest ΔNLL first (quality), "
        "or the fewest estimated bytes first (bytes); the other criterion breaks what is left."))
    cache_auto_bench_steps: int = Field(8, ge=1, le=100_000, description="Decode steps timed per repeat.")
    cache_auto_bench_prompt_len: int = Field(64, ge=1, le=1_000_000, description=(
        "Prompt tokens before the timed decode."))
    cache_auto_bench_repeats: int = Field(3, ge=1, le=1000, description=(
        "Timed repeats after one warm-up (kinds interleaved); the median counts."))
    cache_quality_tasks: TaskGates | None = Field(None, description=(
        "Long-context task gates beside ΔNLL/KL (docs/long-context.md): tasks, lengths, samples, seed, max_drop "
        "(points of 100 against the reference cache, beyond its 95 % interval), per_task. Unset = no task gate."))
    weight_candidates: list[str] | None = Field(None, min_length=1, description=(
        "mode auto-cache-select: also choose the weights' quantization (none, int8, int8-dynamic, int4, int4:g32, "
        "...): a (weights, cache kind) pair whose weights + cache bytes fit memory_budget_mb, gated against the "
        "unquantized model with its own-dtype cache, fastest of the survivors. Unset = choose the cache kind only."))
    memory_budget_mb: float | None = Field(None, gt=0, description=(
        "With weight_candidates: most MiB the weights (measured bytes) and the cache (estimated at max_seq_len × "
        "batch) may take together; cache_budget_mb still bounds the cache alone. Unset = no limit."))
    cache_plan_path: str = Field("plans/cache_plans.json", min_length=1, description=(
        "Where selections are persisted and reused (relative to the working directory)."))
    cache_plan_probe: bool = Field(True, description="Re-measure a persisted plan once it is older than the interval.")
    cache_plan_probe_interval_sec: float = Field(3600, gt=0, description="Age (seconds) after which a plan is stale.")

    @field_validator("cache_candidates")
    @classmethod
    def _known_candidates(cls, value: list[str]) -> list[str]:
        return [checked_kind(kind) for kind in value]

    @field_validator("weight_candidates")
    @classmethod
    def _known_weights(cls, value: list[str] | None) -> list[str] | None:
        if "gguf" in (value or []):
            raise ValueError("gguf is a GGUF file's own formats, not a quantization of the unquantized model the "
                             "candidates are gated against: leave it out (model.quantization: gguf runs the file's)")
        return check_quantizations(value)

    @model_validator(mode="after")
    def _memory_budget_needs_weights(self):
        if self.memory_budget_mb is not None and not self.weight_candidates:
            raise ValueError("memory_budget_mb bounds weights + cache of the weight_candidates: set weight_candidates, "
                             "or use cache_budget_mb for the cache alone")
        return self


ENGINE_DESCRIPTION = (
    "Decode engine: eager (the reference loop over growing caches) or compiled (preallocated caches written in "
    "place, one compiled decode step per batch and length bucket; CUDA graphs on GPU; compile time reported apart "
    "and cached under ~/.cache/runner). Greedy tokens are the same in float32. llama.cpp: llama-cpp-python on the "
    "model's GGUF (the zoo's at its own quantization, a local .gguf, or the torch weights written as an f32 GGUF), KV "
    "types fp32, fp16, bf16, q8_0, q4_0, q4_1 (docs/engines.md; install with make setup-llamacpp).")


def _fits(kind: str | None, max_seq_len: int | None) -> str | None:
    """The kind, when its token counts fit max_seq_len (unknown when max_seq_len itself did not validate)."""
    problem = seq_len_problem(kind, max_seq_len) if max_seq_len is not None else None
    if problem:
        raise ValueError(problem)
    return kind


def _engine_conflicts(engine: str, **settings) -> None:
    """What the compiled engine cannot serve, as an error naming the key."""
    if engine != "compiled":
        return
    for key, value in settings.items():
        if value:
            raise ValueError(f"engine: compiled does not support {key} ({value!r}): remove it or use engine: eager")


class GenerateConfig(AutoCacheConfig):
    """How to decode. `temperature: 0` means greedy; unset filters are off."""

    max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Most tokens to generate per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 = greedy.")
    top_k: int | None = Field(None, ge=0, le=10_000_000,
                              description="Keep the k most likely tokens (0 or unset = off).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass (unset or 1 = off).")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=100.0, description="CTRL-style penalty on tokens already in the sequence (1 = off)."
    )
    eos_token_id: int | list[int] | None = Field(
        None, description="Token id(s) that end a sequence; unset = the tokenizer's / model's EOS."
    )
    stop_strings: list[str] = Field(
        default_factory=list, description="Stop when the generated text contains any of these (not included)."
    )
    max_seq_len: int = Field(2048, ge=1, le=10_000_000, description="Most tokens (prompt + generated) in the cache.")
    engine: Engine = Field("eager", description=ENGINE_DESCRIPTION)
    prefill: TorchEngine = Field("eager", description=(
        "engine: compiled only: prefill the prompt eagerly through the static cache, or compiled, in pieces of 512 "
        "columns and a last piece padded on the right to a power of two from 16 (a few more shapes to compile, "
        "up front: compile time reported apart)."))
    cache_kind: str | None = Field(None, description=(
        "KV-cache storage: fp32, fp16, bf16, q8_0 (q8), q4_0 (q4), q4_1, nf4, kivi4, kivi3, kivi2 (options as in "
        "kivi3:g128:r128:s4:o1, see docs/cache-kinds.md), or auto (selected under cache_budget_mb and the quality "
        "gates); unset = the model's dtype."))
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1,
        description="Seed of the sampling generator; unset = the manifest's seed (0 in the library)."
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0, description=(
        "Keep tokens whose probability is at least min_p × the top token's (unset or 0 = off)."))
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Locally typical sampling mass: keep the tokens closest to the distribution's entropy (unset or 1 = off)."))
    no_repeat_ngram_size: int = Field(0, ge=0, le=1024, description=(
        "Never repeat an n-gram of this size already in the sequence (0 = off)."))
    num_beams: int = Field(1, ge=1, le=64, description="Beam search with this many beams (1 = no beam search).")
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0, description=(
        "Beam search: a finished beam scores sum(logprobs) / new_tokens ** length_penalty (> 0 favours longer)."))
    early_stopping: bool | Literal["never"] = Field(False, description=(
        "Beam search: true = stop once num_beams beams have finished; false = stop when no running beam can "
        "plausibly improve (transformers' heuristic); never = only when none can improve at all."))
    num_return_sequences: int = Field(1, ge=1, le=64, description=(
        "Beam search: the best sequences returned per prompt (at most num_beams)."))
    penalty_alpha: float | None = Field(None, ge=0.0, le=1.0, description=(
        "Contrastive search (with top_k > 1): score = (1 − α)·p(token) − α·max cosine similarity of its hidden "
        "state to the previous ones (unset or 0 = off)."))
    decode_plan: Literal["auto", "fixed", "none"] = Field("none", description=(
        "Long-context plan: none = whole prefill, full cache; fixed = always decode_q_chunk and "
        "decode_local_window; auto = by prompt + max_new_tokens: ≤ decode_bucket_short as none, ≤ "
        "decode_bucket_mid chunked prefill only, longer chunked prefill + sliding window. Printed and recorded."))
    decode_bucket_short: int = Field(512, ge=1, le=10_000_000, description=(
        "decode_plan auto: sequences up to this many tokens use no chunking and the full cache."))
    decode_bucket_mid: int = Field(2048, ge=1, le=10_000_000, description=(
        "decode_plan auto: sequences up to this many tokens use chunked prefill and the full cache; longer "
        "ones also the sliding window."))
    decode_q_chunk: int | None = Field(128, ge=1, le=10_000_000, description=(
        "Prefill the prompt in chunks of this many tokens (lower peak memory, same logits); unset = whole."))
    decode_local_window: int | None = Field(512, ge=1, le=10_000_000, description=(
        "Sliding-window cache: keep only the newest this many tokens (plus decode_sink_tokens); lossy; "
        "unset = full cache."))
    decode_sink_tokens: int = Field(4, ge=0, le=10_000_000, description=(
        "Attention-sink tokens: the first cache slots kept forever when the sliding window is on."))
    llamacpp: LlamaCppOptions | None = Field(None, description=(
        "engine: llama.cpp only: threads, batch (prompt tokens per forward), flash_attn; unset = llama.cpp's "
        "defaults (every core, 512, flash attention exactly when V is quantized)."))

    @field_validator("cache_kind")
    @classmethod
    def _known_kind(cls, value: str | None, info) -> str | None:
        return _fits(checked_kind(value), info.data.get("max_seq_len"))

    @model_validator(mode="after")
    def _strategies_combine(self) -> GenerateConfig:
        """Settings that contradict each other are an error here, not a surprise in the middle of a run."""
        if self.num_beams > 1:
            off = {"top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0), "typical_p": (None, 1.0),
                   "penalty_alpha": (None, 0.0)}
            sampling = [k for k, values in off.items() if getattr(self, k) not in values]
            if self.temperature not in (0.0, 1.0):  # 0 and 1 leave the log-probabilities as they are
                sampling.insert(0, "temperature")
            if sampling:
                raise ValueError(f"beam search (num_beams > 1) is deterministic: remove {', '.join(sampling)} "
                                 f"(beam sampling is not supported)")
            if self.stop_strings:
                raise ValueError("stop_strings are not supported with beam search: use eos_token_id")
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams "
                             f"({self.num_beams})")
        if self.contrastive:
            if self.temperature not in (0.0, 1.0):
                raise ValueError("contrastive search (penalty_alpha with top_k) is deterministic: remove temperature")
            if self.top_p not in (None, 1.0) or self.min_p or self.typical_p not in (None, 1.0):
                raise ValueError("contrastive search takes top_k candidates: remove top_p, min_p and typical_p")
        elif self.penalty_alpha and not (self.top_k and self.top_k > 1):
            raise ValueError("penalty_alpha (contrastive search) needs top_k > 1 candidates, e.g. top_k: 4")
        written = "cache_candidates" in self.model_fields_set and self.cache_candidates != list(DEFAULT_CANDIDATES)
        for i, candidate in enumerate(self.cache_candidates if written else ()):  # a step's block carries the
            problem = seq_len_problem(candidate, self.max_seq_len)  # defaults written out: the gates judge those
            if problem:
                raise ValueAt(("cache_candidates", i), problem)
        if self.decode_bucket_mid < self.decode_bucket_short:
            raise ValueError(f"decode_bucket_mid ({self.decode_bucket_mid}) must be ≥ decode_bucket_short "
                             f"({self.decode_bucket_short})")
        if self.decode_plan != "none" and self.cache_kind and self.cache_kind.startswith("kivi"):
            raise ValueError("the sliding window (decode_plan) does not support KIVI cache kinds: use fp16, q8_0, "
                             "q4_0, q4_1 or nf4, or decode_plan: none")
        if self.prefill == "compiled" and self.engine != "compiled":
            raise ValueError("prefill: compiled needs engine: compiled (the eager engine prefills eagerly)")
        if self.engine == "compiled" and (reason := compiled_eviction_reason(self.cache_kind, prefill=self.prefill)):
            raise ValueError(f"engine: compiled: {reason}")
        if self.decode_plan != "none" and self.cache_kind and "+" in self.cache_kind:
            raise ValueError("the sliding window (decode_plan) does not stack with eviction (the cache kind's "
                             "'+...'): use decode_plan: none, or streaming eviction for sinks + a recent window")
        _engine_conflicts(self.engine, penalty_alpha=self.penalty_alpha if self.contrastive else None,
                          decode_plan=self.decode_plan if self.decode_plan != "none" else None)
        self._llamacpp_conflicts()
        return self

    def _llamacpp_conflicts(self) -> None:
        """What llama.cpp cannot do is refused here, never silently ignored (docs/engines.md)."""
        if self.engine != "llama.cpp":
            if self.llamacpp is not None:
                raise ValueError("llamacpp settings apply to engine: llama.cpp only: remove them or set that engine")
            return
        if reason := kind_refusal(self.cache_kind) or quantized_v_problem(self.cache_kind, self.llamacpp):
            raise ValueAt(("cache_kind",), reason)
        written = "cache_candidates" in self.model_fields_set and self.cache_candidates != list(DEFAULT_CANDIDATES)
        for i, candidate in enumerate(self.cache_candidates if written else ()):
            if reason := kind_refusal(candidate) or quantized_v_problem(candidate, self.llamacpp):
                raise ValueAt(("cache_candidates", i), reason)
        unsupported = {"num_beams": self.num_beams if self.num_beams > 1 else None,
                       "penalty_alpha": self.penalty_alpha, "no_repeat_ngram_size": self.no_repeat_ngram_size,
                       "decode_plan": self.decode_plan if self.decode_plan != "none" else None,
                       "weight_candidates": self.weight_candidates}
        for key, value in unsupported.items():
            if value:
                raise ValueError(f"engine: llama.cpp does not support {key} ({value!r}): remove it or use engine: "
                                 "eager")

    @property
    def contrastive(self) -> bool:
        return bool(self.penalty_alpha) and bool(self.top_k and self.top_k > 1)

    @field_validator("eos_token_id")
    @classmethod
    def _eos_non_negative(cls, value):
        ids = value if isinstance(value, list) else [value] if value is not None else []
        if any(i < 0 for i in ids):
            raise ValueError("token ids are non-negative integers")
        return value

    @field_validator("stop_strings")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("an empty stop string would stop at once")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculativeConfig(BaseModel):
    """Speculative decoding settings, the seed guide's names verbatim: a draft proposes, the target verifies.

    `temperature: 0` means greedy (the output is then the target's greedy output token for token).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec_k: int = Field(4, ge=1, le=64, description=(
        "Tokens the draft proposes per round (the start value when adaptive)."))
    spec_k_adaptive: bool = Field(False, description=(
        "Adapt k each round: +1 after a fully accepted round, -1 after one with acceptance < 0.5, "
        "within [1, 2·spec_k]."))
    spec_method: Literal["reject_sampling", "greedy"] = Field("reject_sampling", description=(
        "Verification: reject_sampling (accept with min(1, p/q), resample from norm(max(p-q, 0))) or greedy "
        "(exact match: accept while the draft token equals the target's own choice)."))
    spec_extra_token: bool = Field(True, description=(
        "After a fully accepted round, also take the target's next token (k+1 tokens per target forward)."))
    spec_disable_below_accept: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Fall back to target-only decoding when the recent acceptance rate falls below this (0 = never)."))
    max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Most tokens to generate per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 = greedy.")
    top_k: int | None = Field(None, ge=0, le=10_000_000,
                              description="Keep the k most likely tokens (0 or unset = off).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass (unset or 1 = off).")
    max_seq_len: int = Field(2048, ge=1, le=10_000_000, description="Most tokens (prompt + generated) in a cache.")
    engine: TorchEngine = Field("eager", description=ENGINE_DESCRIPTION.split(" llama.cpp:")[0])
    cache_kind: str | None = Field(None, description=(
        "KV-cache storage of target and draft: fp32, fp16, bf16, q8_0 (q8), q4_0 (q4), q4_1, nf4, kivi4, kivi3, "
        "kivi2 (options as in kivi3:g64:r128:s4:o1); unset = the model's dtype. auto is not supported here."))
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description=(
        "Seed of the generator of every random draw; unset = the manifest's seed (0 in the library)."))

    @field_validator("cache_kind")
    @classmethod
    def _known_kind(cls, value: str | None, info) -> str | None:
        if value == "auto":
            raise ValueError("cache_kind 'auto' is not supported in speculative decoding: name a kind "
                             "(the auto-cache-select mode can choose one)")
        return _fits(checked_kind(value), info.data.get("max_seq_len"))

    @model_validator(mode="after")
    def _no_eviction(self):
        if reason := speculative_eviction_reason(self.cache_kind):
            raise ValueError(reason)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
