"""KV-cache kinds as transformers cache layers, and their measured size.

`fp32`, `fp16`, `bf16` keep K/V in that dtype and hand attention the model's dtype. A kind equal
to the model's dtype is transformers' own DynamicLayer, so `model.generate(past_key_values=...)`
and our decode loop see the same cache. Quantized kinds arrive with the auto-cache-select work.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CastLayer(DynamicLayer):
    """Stores K/V in `storage_dtype`; attention reads them back in the dtype they arrived in."""

    storage_dtype: torch.dtype = torch.float16

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.compute_dtype, self.device = key_states.dtype, key_states.device
        self.dtype = self.storage_dtype
        self.keys = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.values = torch.empty(0, dtype=self.storage_dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)


CACHE_KINDS: dict[str, type[CastLayer]] = {
    name: type(f"{name.upper()}Layer", (CastLayer,), {"storage_dtype": dtype}) for name, dtype in STORAGE_DTYPES.items()
}


def make_cache(kind: str | None, model) -> Cache:
    """An empty cache of `kind` for `model`; None or the model's own dtype → transformers' DynamicCache."""
    if kind is None or STORAGE_DTYPES[kind] == model.dtype:
        return DynamicCache(config=model.config)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[CACHE_KINDS[kind]() for _ in range(n_layers)])


def cache_bytes(cache: Cache) -> int:
    """Bytes the cache really holds (measured from its tensors, not estimated)."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total
