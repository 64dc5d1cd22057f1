"""GenerateConfig: the decoding settings, with the seed guide's names verbatim.

Inert: validators check and normalise values, they never touch torch, devices or disk, so the
manifest schema can reuse this class without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CacheKindName = Literal["fp32", "fp16", "bf16"]


class GenerateConfig(BaseModel):
    """How to decode. `temperature: 0` means greedy; unset filters are off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    cache_kind: CacheKindName | None = Field(
        None, description="KV-cache storage: fp32, fp16, bf16; unset = the model's own dtype."
    )
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
