"""GenerateConfig: the decoding settings, with the seed guide's names verbatim.

Inert: validators check and normalise values, they never touch torch, devices or disk, so the
manifest schema can reuse this class without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CacheKindName = Literal["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4", "q4_1", "kivi4", "kivi2", "q8", "q4"]
KIND_ALIASES = {"q8": "q8_0", "q4": "q4_0"}
DEFAULT_CANDIDATES = ("fp16", "q8_0", "nf4", "q4_0")


def canonical_kind(kind: str) -> str:
    """`q8` → `q8_0`, `q4` → `q4_0`; other names unchanged."""
    return KIND_ALIASES.get(kind, kind)


class AutoCacheConfig(BaseModel):
    """How `cache_kind: auto` chooses: budget filter → quality gates → speed pick → persisted plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_candidates: list[CacheKindName] = Field(
        default_factory=lambda: list(DEFAULT_CANDIDATES), min_length=1,
        description="Kinds to consider, in order of preference (ties and cache_auto_benchmark: false).")
    cache_budget_mb: float | None = Field(None, gt=0, description=(
        "Most MB the cache may take at max_seq_len × batch (estimated); unset = no limit."))
    cache_quality_max_delta_nll: float = Field(0.05, ge=0, description=(
        "Most mean NLL increase (nats/token) of teacher-forced tokens decoded through the cache."))
    cache_quality_max_ppl_ratio: float = Field(1.05, ge=1.0, description=(
        "Most perplexity ratio candidate / reference over cache_quality_ppl_len tokens."))
    cache_quality_max_mean_kl: float = Field(0.1, ge=0, description=(
        "Most mean KL(reference ‖ candidate) of next-token distributions (decode steps and needle answer), nats."))
    cache_quality_prompt_len: int = Field(64, ge=1, le=1_000_000, description="Tokens prefilled before the teacher-forced decode steps.")
    cache_quality_decode_steps: int = Field(4, ge=1, le=10_000, description="Teacher-forced decode steps per window.")
    cache_quality_windows: int = Field(8, ge=1, le=1024, description="Text windows (a batch) the NLL and KL average over.")
    cache_quality_ppl_len: int = Field(512, ge=2, le=1_000_000, description="Tokens in the perplexity window (capped by max_seq_len).")
    cache_quality_data: str = Field("pydoc", min_length=1, description=(
        "Evaluation text: pydoc, shakespeare, britannica, a .txt file (relative to the manifest) or hf:REPO/FILE."))
    cache_quality_on_fail: Literal["error", "reference"] = Field("reference", description=(
        "When no candidate passes the gates: fail the step, or use the reference kind (recorded as gate_failed)."))
    cache_auto_benchmark: bool = Field(True, description="Time the survivors and pick the fastest median; off = first survivor.")
    cache_auto_bench_steps: int = Field(8, ge=1, le=100_000, description="Decode steps timed per repeat.")
    cache_auto_bench_prompt_len: int = Field(64, ge=1, le=1_000_000, description="Prompt tokens before the timed decode.")
    cache_auto_bench_repeats: int = Field(3, ge=1, le=1000, description="Timed repeats after one warm-up; the median counts.")
    cache_plan_path: str = Field("plans/cache_plans.json", min_length=1, description=(
        "Where selections are persisted and reused (relative to the working directory)."))
    cache_plan_probe: bool = Field(True, description="Re-measure a persisted plan once it is older than the interval.")
    cache_plan_probe_interval_sec: float = Field(3600, gt=0, description="Age (seconds) after which a plan is stale.")


class GenerateConfig(AutoCacheConfig):
    """How to decode. `temperature: 0` means greedy; unset filters are off."""

    max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Most tokens to generate per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 = greedy.")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens (0 or unset = off).")
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
    cache_kind: CacheKindName | Literal["auto"] | None = Field(None, description=(
        "KV-cache storage: fp32, fp16, bf16, q8_0 (q8), q4_0 (q4), nf4, or auto (selected under "
        "cache_budget_mb and the quality gates); unset = the model's own dtype."))
    seed: int | None = Field(
        None, description="Seed of the sampling generator; unset = the manifest's seed (0 in the library)."
    )

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
