"""Decode planning for long prompts: chunked prefill and a sliding-window KV cache with attention sinks.

The plan (`plan_decode`) follows the seed guide's `decode_plan`:
    none   whole prefill, full cache (the layers' defaults)
    fixed  always decode_q_chunk and decode_local_window (either unset = off)
    auto   by the sequence's length L = prompt + max_new_tokens: L ≤ decode_bucket_short → as none;
           L ≤ decode_bucket_mid → chunked prefill, full cache; longer → chunked prefill + sliding window.
Chunked prefill is exact (same logits, lower peak memory); the window is lossy, so a plan that turns it on
says so in `describe()` (the generate step prints and records it) and its ΔNLL is measured by
benchmarks/long_context.py (quality.planned_nll).

The window cache keeps the first `sinks` slots and the newest `window` slots of every layer (StreamingLLM,
arXiv 2309.17453); keys keep the positions they were rotated with. Eviction happens after attention, so the
tokens of a forward always see each other and everything kept before them. The caller keeps its 2-D attention
mask in step with `forward.trim_mask`, which asks the layer's `keep_columns`. Sinks are cache slots: in a
left-padded row the first slots may be pads.
Owns the plan and the window layers; does not know about decoding loops or manifests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from runner.infer.cache.layers import QuantLayer
from runner.infer.cache.registry import KINDS, make_cache, native
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import parse_kind


@dataclass(frozen=True)
class DecodePlan:
    """What applies to one call: prefill chunk, window and sinks (None = off) and why."""

    decode_plan: str  # auto, fixed, none: what was asked
    bucket: str  # short, mid, long (auto), fixed or none: what was picked
    seq_len: int  # prompt + max_new_tokens the bucket was chosen for
    q_chunk: int | None
    local_window: int | None
    sink_tokens: int

    def describe(self) -> str:
        chunk = f"prefill in chunks of {self.q_chunk}" if self.q_chunk else "whole prefill"
        cache = (f"SLIDING WINDOW of {self.local_window} tokens + {self.sink_tokens} sink tokens (lossy)"
                 if self.local_window else "full cache")
        return f"decode_plan {self.decode_plan} → {self.bucket} (L = {self.seq_len}): {chunk}, {cache}"

    def as_dict(self) -> dict:
        return asdict(self)


def plan_decode(config: GenerateConfig, prompt_len: int) -> DecodePlan:
    """The plan for a prompt of `prompt_len` tokens (pure: no tensors, no devices)."""
    seq_len = prompt_len + config.max_new_tokens
    chunk, window, sinks = config.decode_q_chunk, config.decode_local_window, config.decode_sink_tokens
    if config.decode_plan == "none":
        return DecodePlan("none", "none", seq_len, None, None, sinks)
    if config.decode_plan == "fixed":
        return DecodePlan("fixed", "fixed", seq_len, chunk, window, sinks)
    if seq_len <= config.decode_bucket_short:
        return DecodePlan("auto", "short", seq_len, None, None, sinks)
    if seq_len <= config.decode_bucket_mid:
        return DecodePlan("auto", "mid", seq_len, chunk, None, sinks)
    return DecodePlan("auto", "long", seq_len, chunk, window, sinks)


def keep_slots(tensor: torch.Tensor, sinks: int, window: int, dim: int) -> torch.Tensor:
    """The first `sinks` and the last `window` entries along `dim` (all of them when that is no fewer)."""
    n = tensor.shape[dim]
    if n <= sinks + window:
        return tensor
    return torch.cat([tensor.narrow(dim, 0, sinks), tensor.narrow(dim, n - window, window)], dim=dim)


class WindowMixin(DynamicLayer):
    """Put before a cache layer class (DynamicLayer or a subclass): after each update, evict all but the sinks and
    the newest window."""

    def __init__(self, window: int, sinks: int, **kwargs):
        super().__init__(**kwargs)
        self.window, self.sinks = window, sinks

    def keep_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """[B,n] mask of what was fed → the columns this layer still holds (forward.trim_mask asks)."""
        return keep_slots(mask, self.sinks, self.window, dim=1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # attention sees all of these
        evict = lambda t: keep_slots(t, self.sinks, self.window, dim=-2)  # noqa: E731
        if isinstance(self, QuantLayer):
            self._map(evict)
        else:
            self.keys, self.values = evict(self.keys), evict(self.values)
        return keys, values


def make_window_cache(kind: str | None, model, window: int, sinks: int) -> Cache:
    """An empty sliding-window cache of `kind` (None = the model's dtype). KIVI kinds are not supported."""
    options = parse_kind(kind)
    if options is not None and options.family == "kivi":
        raise ValueError("the sliding window does not support KIVI cache kinds")
    if options is not None and options.eviction is not None:
        raise ValueError(f"cache kind {kind!r} evicts tokens already: it does not stack with the sliding window "
                         f"(decode_local_window); streaming eviction keeps sinks + a recent window")
    base, args = ((DynamicLayer, {}) if options is None or native(options, model.dtype) else
                  (KINDS[options.name].eager, {"options": options}))
    layer = type(f"Window{base.__name__}", (WindowMixin, base), {})
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[layer(window=window, sinks=sinks, **args) for _ in range(n_layers)])


def make_planned_cache(kind: str | None, model, plan: DecodePlan) -> Cache:
    if plan.local_window:
        return make_window_cache(kind, model, plan.local_window, plan.sink_tokens)
    return make_cache(kind, model)
