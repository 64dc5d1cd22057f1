"""The `eval` block (mode: eval): the long-context task suite (docs/long-context.md) run with each cache kind —
quantized, evicting (`q8_0+snapkv:0.5`) or both — into one table of task × length × cache kind with scores, their
95 % intervals and the cache's bytes. The same suite gates cache selection (`cache_quality_tasks`).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from runner.errors import ValueAt
from runner.infer.config.kinds import checked_kind
from runner.infer.config.tasks import TaskSuite
from runner.manifest.blocks import Strict


class EvalBlock(TaskSuite, Strict):
    """Every task at every length, scored with the model's own uncompressed cache (the reference) and each kind."""

    cache_kinds: list[str] = Field(default_factory=list, description=(
        "Cache kinds to score beside the reference (the model's dtype): quantized (q8_0, q4_0, kivi4, ...), "
        "evicting (fp16+snapkv:0.5, fp16+streaming:0.75:s4) or both (q4_0+snapkv:0.5)."))
    prefill_chunk: int = Field(512, ge=16, le=1_000_000, description=(
        "Prompt tokens fed per forward: bounds the attention scores' memory; the scores do not depend on it."))

    @model_validator(mode="after")
    def _known_kinds(self) -> EvalBlock:
        """Each bad kind reported at itself (cache_kinds[1])."""
        for i, kind in enumerate(self.cache_kinds):
            try:
                checked_kind(kind)
            except ValueError as error:
                raise ValueAt(("cache_kinds", i), str(error)) from None
            if kind in self.cache_kinds[:i]:
                raise ValueAt(("cache_kinds", i), f"cache kind {kind!r} is listed twice")
        return self
