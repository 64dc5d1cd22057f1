"""Deciding a cache kind before generation: the one function that turns `cache_kind: auto` into a kind.

    decide_cache_kind(config, batch_size) → cache_kind auto: select_cache_kind (a fresh persisted plan, or measured)
                                          → (config with the chosen kind, the Selection)
                                          → any other kind: (config, None), nothing selected
The generate step calls it once before it decodes; the Generator calls it for `cache_kind: auto` once per batch
size, before its first forward. Decoding itself never selects. Does not show or record anything.
"""

from __future__ import annotations

from pathlib import Path

from runner.infer.config.decoding import GenerateConfig
from runner.infer.loading.texts import EvalText
from runner.infer.select.autocache import Selection, select_cache_kind
from runner.report import ProgressFactory, no_progress


def decide_cache_kind(model, tokenizer, config: GenerateConfig, *, batch_size: int, identity: dict | None = None,
                      text: EvalText | None = None, base_dir: Path | None = None,
                      progress: ProgressFactory = no_progress) -> tuple[GenerateConfig, Selection | None]:
    """`config` with a decided cache kind, and the Selection that decided it (None when `config` named a kind).
    The budget is per batch: `batch_size` is the batch the kind will decode."""
    if config.cache_kind != "auto":
        return config, None
    selection = select_cache_kind(model, tokenizer, config, batch_size=batch_size, identity=identity, text=text,
                                  base_dir=base_dir, progress=progress)
    return config.model_copy(update={"cache_kind": selection.kind}), selection
