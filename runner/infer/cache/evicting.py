"""Eviction applied to every cache kind: a layer mixin that stores only the kept tokens, and the attention hooks
that hand it what it scores with.

How (kvpress hooks the attention module and compresses the layer's cache after its forward; here the choice is
made inside the layer's `update`, before anything is stored, so it works on every kind alike):
  - a forward pre-hook on each attention module (installed once per model, idempotent, doing nothing for a layer
    without eviction) puts the module, its input hidden states, position embeddings, position ids and attention
    mask on the cache layer (`EvictInputs`);
  - a prompt forward (t > 1 tokens) comes to the layer's `update` with its exact post-RoPE K/V [B,H,t,D]: the
    layer scores them (cache/eviction.py; queries recomputed from the hidden states), keeps ceil(t·(1 − ratio))
    per (row, KV head), in order, and stores only those through the kind's own update. So the kept tokens are
    coded from float K/V exactly as if they alone had been fed: a gather of the block kinds' codes would give the
    same bytes, and a KIVI layer codes its key groups and residual over the kept tokens (no second rounding).
    The forward's own attention sees every token it brought, as they arrived (kvpress: full prompt attention);
  - decode steps (t = 1) append as usual; with a schedule (e<N>) every N steps a layer holding more than its size
    after the prompt forward is compressed back to it, scored with the queries of the last N tokens: a gather of
    stored codes for the float and block kinds (exact), dequantize → gather → code again for KIVI (a second
    rounding of the tokens kept, the only inexact step).
Columns: a row's kept columns replace the forward's columns in the caller's mask through `keep_columns`
(forward.trim_mask). Pads (from the attention mask) score −inf and go first, so a left-padded row keeps its real
tokens first; rows share one kept count (ceil of the forward's columns × (1 − ratio)), so a row with fewer real
tokens than that keeps them all plus masked pads. Every head of a row keeps as many pads (they are the −inf
columns), so one mask per row stays right. Positions are the decode state's `seen`, never the cache's length.
Owns `EvictingMixin`, `EvictInputs`, `install_hooks`, `evicting_layer`. Does not know kinds' byte counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from runner.infer.cache import eviction
from runner.infer.cache.layers import KiviLayer, QuantLayer
from runner.infer.config.eviction import EvictionOptions

HOOKED = "_runner_eviction_hooks"  # set on a model once its attention modules carry the pre-hook
RECEIVES = "receives_evict_inputs"  # where this attribute is true on a cache or on its layer, the pre-hook puts
# the forward's inputs on the layer (`evict_inputs`): EvictingMixin always, a static cache within a scored forward


@dataclass
class EvictInputs:
    """What the attention module received, for its layer to score with."""

    module: Any  # the attention module (q_proj, q_norm, head_dim)
    hidden: torch.Tensor  # [B,t,hidden]
    cos: torch.Tensor  # [B,t,D]
    sin: torch.Tensor
    position_ids: torch.Tensor | None  # [B,t]
    mask: torch.Tensor | None  # 4-D attention mask [B,1,t,kv] (bool or additive) or None: nothing masked
    rotary: Any  # the model's rotary embedding (Expected Attention's future positions)
    scores: dict = field(default_factory=dict, repr=False)  # by what decides them: kinds that share a forward
    # (tasks/evaluate._tee hands every cache the same inputs and K/V) score once per method, whatever they store

    def valid(self, columns: int) -> torch.Tensor | None:
        """[B,columns] bool: which of the last `columns` key columns are real (the last query's row); None: all."""
        if self.mask is None or self.mask.dim() != 4:
            return None
        row = self.mask[:, 0, -1, -columns:]
        return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


def install_hooks(model) -> None:
    """Put the pre-hook on every attention module of `model` (once: a second call does nothing)."""
    if getattr(model, HOOKED, False):
        return
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    rotary = getattr(base, "rotary_emb", None)
    for layer in base.layers:
        layer.self_attn.register_forward_pre_hook(_hook(rotary), with_kwargs=True)
    object.__setattr__(model, HOOKED, True)


def _hook(rotary):
    def pre_hook(module, args, kwargs):
        cache = kwargs.get("cache")
        layers = getattr(cache, "layers", None)
        if not layers or module.layer_idx >= len(layers):
            return None
        if not (getattr(cache, RECEIVES, False) or getattr(layers[module.layer_idx], RECEIVES, False)):
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        layers[module.layer_idx].evict_inputs = EvictInputs(module, hidden, cos, sin, kwargs.get("position_ids"),
                                                            kwargs.get("attention_mask"), rotary)
        return None
    return pre_hook


class EvictingMixin(DynamicLayer):
    """Put before a cache layer class (DynamicLayer or one of layers.py's): store only what eviction keeps."""

    receives_evict_inputs = True  # the pre-hook hands every forward's inputs (RECEIVES)

    def __init__(self, eviction_options: EvictionOptions, **kwargs):
        super().__init__(**kwargs)
        self.eviction = eviction_options
        self.evict_inputs: EvictInputs | None = None
        self.target = 0  # tokens held after the last prompt forward: what the schedule compresses back to
        self.steps = 0  # decode steps since the schedule last looked
        self.recent: list[EvictInputs] = []  # the last `every` decode steps' inputs
        self.pending: tuple[int, int, torch.Tensor] | None = None  # (start, end, kept mask [B,k]) for keep_columns
        self.kept_index: torch.Tensor | None = None  # the last evicting prompt forward's kept columns [B,H,k]

    def keep_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """[B,n] mask of what was fed → the columns this layer holds (forward.trim_mask asks)."""
        if self.pending is None:
            return mask
        start, end, kept = self.pending
        self.pending = None
        assert mask.shape[1] == end, f"a mask of {mask.shape[1]} columns for a cache that evicted at {end}"
        return torch.cat([mask[:, :start], kept.to(mask.dtype), mask[:, end:]], dim=1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        inputs, self.evict_inputs, self.pending = self.evict_inputs, None, None
        t = key_states.shape[-2]
        if inputs is None or t == 1:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if inputs is not None and self.eviction.every:
                self._schedule(inputs, keys, values)
            return keys, values
        kept = self.eviction.kept(t)
        if kept >= t:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.target, self.steps, self.recent = self.get_seq_length(), 0, []
            return keys, values
        held = self.get_seq_length()
        valid = inputs.valid(t)
        index = self._choose(inputs, key_states, value_states, valid, kept, first=0)  # [B,H,k]
        self.kept_index = index  # columns of this forward (0 = its first token): benchmarks compare kept sets
        whole_keys, whole_values = super().update(gather_columns(key_states, index),
                                                  gather_columns(value_states, index), *args, **kwargs)
        self.target, self.steps, self.recent = self.get_seq_length(), 0, []
        self.pending = (held, held + t, kept_mask(valid, index, key_states))
        return (torch.cat([whole_keys[..., :held, :], key_states], dim=-2),
                torch.cat([whole_values[..., :held, :], value_states], dim=-2))

    def _schedule(self, inputs: EvictInputs, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step under e<N>: every N steps, back down to the target, scored with the last N queries."""
        every = self.eviction.every
        self.recent = [*self.recent, inputs][-every:]
        self.steps += 1
        if self.steps < every:
            return
        self.steps, recent, self.recent = 0, self.recent, []
        n = keys.shape[-2]
        if n <= self.target or not self.target:
            return
        merged = EvictInputs(inputs.module, torch.cat([r.hidden for r in recent], 1),
                             torch.cat([r.cos for r in recent], 1), torch.cat([r.sin for r in recent], 1),
                             inputs.position_ids, inputs.mask, inputs.rotary)
        valid = inputs.valid(n)
        index = self._choose(merged, keys, values, valid, self.target, first=n - len(recent))
        self._gather_stored(index, keys, values)
        self.pending = (0, n, kept_mask(valid, index, keys))

    def _choose(self, inputs: EvictInputs, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                kept: int, first: int) -> torch.Tensor:
        return choose_columns(self.eviction, inputs, keys, values, valid, kept, first)

    def _gather_stored(self, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep only the columns `index` [B,H,k] of what the layer stores (keys / values: it all, dequantized)."""
        if isinstance(self, KiviLayer):  # codes over groups of tokens: code the kept tokens again
            self.is_initialized = False
            KiviLayer.update(self, gather_columns(keys, index), gather_columns(values, index))
        elif isinstance(self, QuantLayer):  # one token's codes stand alone: a gather is exact
            self._map(lambda t: gather_columns(t, index))
        else:
            assert self.keys is not None and self.values is not None, "a layer that holds tokens"
            self.keys, self.values = gather_columns(self.keys, index), gather_columns(self.values, index)


def choose_columns(options: EvictionOptions, inputs: EvictInputs, keys: torch.Tensor, values: torch.Tensor,
                   valid: torch.Tensor | None, kept: int, first: int) -> torch.Tensor:
    """The kept columns [B,H,kept] of keys / values [B,H,n,D] (valid [B,n] or None: all real); the queries (inputs)
    are columns first..n−1. The eager layers' choice, and the compiled engine's (compiled/state.py)."""
    module = inputs.module

    def q_post(columns: int | None) -> torch.Tensor:
        part = slice(-columns if columns else None, None)
        return eviction.queries(module, inputs.hidden[:, part], inputs.cos[:, part], inputs.sin[:, part])

    def future() -> tuple[torch.Tensor, torch.Tensor]:
        start = (int(inputs.position_ids.max()) + 1 if inputs.position_ids is not None
                 else first + inputs.hidden.shape[1])
        positions = torch.arange(start, start + eviction.FUTURE_POSITIONS, device=keys.device)[None]
        cos, sin = inputs.rotary(keys, positions)
        return cos[0], sin[0]

    decided_by = (options.method, options.sinks, options.window, first, keys.data_ptr(), tuple(keys.shape))
    with torch.no_grad():
        if (scores := inputs.scores.get(decided_by)) is None:
            scores = inputs.scores[decided_by] = eviction.score(
                options, module, keys, values, valid, q_post, lambda: eviction.queries(module, inputs.hidden), future,
                first)
        window = min(options.window, keys.shape[-2] - first) if first else options.window
        return eviction.choose(scores, kept, valid, options.sinks, window)


def gather_columns(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B,H,n,C] → [B,H,k,C] at the columns index [B,H,k]."""
    return t.gather(-2, index[..., None].expand(*index.shape, t.shape[-1]))


def kept_mask(valid: torch.Tensor | None, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B,k] mask of the kept columns (every head of a row keeps as many pads, first: head 0 stands for all)."""
    if valid is None:
        return torch.ones(index.shape[0], index.shape[-1], dtype=torch.long, device=like.device)
    return valid.gather(1, index[:, 0]).long()


def evicting_layer(base: type) -> type:
    """The class of `base` (DynamicLayer or a layers.py class) that evicts: EvictingMixin before it."""
    return _CLASSES.setdefault(base, type(f"Evicting{base.__name__}", (EvictingMixin, base), {}))


_CLASSES: dict[type, type] = {}
