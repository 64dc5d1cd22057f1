"""The cache kinds, one entry each: which class stores it eagerly, which preallocated class stores it for the
compiled engine, which estimator says its bytes, and which stored formats the C++ attention kernel reads it in.

Adding a kind: its name in config/kinds.py's grammar (KIND_NAMES, and its family), its entry here, its classes
(an eager layer in layers.py, a static layer in static/), an estimator in sizes.py when no family's fits; a new
stored format is a kernel `Format` (kernels/csrc) and its name in kernels/cpu_attention.FORMATS.
Owns: `KINDS`, `make_cache` and the byte estimates over a model config (`estimate_cache_bytes`, `bytes_per_token`,
`residual_bytes`); static/cache.make_static_cache builds the compiled engine's caches from the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from runner.infer.cache import layers
from runner.infer.cache.codebooks import fitted_levels
from runner.infer.cache.evicting import evicting_layer, install_hooks
from runner.infer.cache.layers import STORAGE_DTYPES
from runner.infer.cache.sizes import BlockSizes, FloatSizes, KiviSizes, Sizes, dims, float_per_token, native_bytes
from runner.infer.cache.static.kivi import StaticKiviLayer
from runner.infer.cache.static.plain import StaticPlainLayer, StaticQuantLayer
from runner.infer.config.kinds import KindOptions, parse_kind


@dataclass(frozen=True)
class KindEntry:
    """One kind's classes. `eager` and `static` are built as cls(options, …) (KIVI's also take `levels`);
    `formats` are the (key, value) stored formats cpu_attention's kernel reads the static layer in."""

    eager: type
    static: type[StaticPlainLayer]
    sizes: type[Sizes]
    formats: tuple[str, str]


def _entry(eager: type, static: type[StaticPlainLayer], sizes: type[Sizes], key: str, value: str = "") -> KindEntry:
    return KindEntry(eager, static, sizes, (key, value or key))


KINDS: dict[str, KindEntry] = {
    "fp32": _entry(layers.FP32Layer, StaticPlainLayer, FloatSizes, "fp32"),
    "fp16": _entry(layers.FP16Layer, StaticPlainLayer, FloatSizes, "fp16"),
    "bf16": _entry(layers.BF16Layer, StaticPlainLayer, FloatSizes, "bf16"),
    "q8_0": _entry(layers.Q8_0Layer, StaticQuantLayer, BlockSizes, "q8_0"),
    "q4_0": _entry(layers.Q4_0Layer, StaticQuantLayer, BlockSizes, "q4_0"),
    "q4_1": _entry(layers.Q4_1Layer, StaticQuantLayer, BlockSizes, "q4_1"),
    "nf4": _entry(layers.NF4Layer, StaticQuantLayer, BlockSizes, "nf4"),
    "kivi4": _entry(layers.Kivi4Layer, StaticKiviLayer, KiviSizes, "kivi_key", "kivi_value"),
    "kivi3": _entry(layers.Kivi3Layer, StaticKiviLayer, KiviSizes, "kivi_key", "kivi_value"),
    "kivi2": _entry(layers.Kivi2Layer, StaticKiviLayer, KiviSizes, "kivi_key", "kivi_value"),
}
NATIVE_KINDS = {dtype: name for name, dtype in STORAGE_DTYPES.items()}  # a model's dtype → the kind storing it


def native(options: KindOptions | None, dtype: torch.dtype) -> bool:
    """Whether a cache of `options` (None: the model's dtype) for a model in `dtype` is transformers' own."""
    return options is None or STORAGE_DTYPES.get(options.name) == dtype


def layer_levels(model, options: KindOptions, n_layers: int) -> list[dict]:
    """Per model layer, the extra arguments of its cache layer: the fitted levels of a nuq kind (once per model and
    options, then read from the cache folder), else none."""
    if options.nuq:
        levels = fitted_levels(model, options)
        return [{"levels": levels[i]} for i in range(n_layers)]
    return [{} for _ in range(n_layers)]


def make_cache(kind: str | None, model) -> Cache:
    """An empty cache of `kind` (aliases, options ok) for `model`; None or the model's own dtype → DynamicCache.

    With eviction (`q8_0+snapkv:0.5`), each layer is the kind's class (DynamicLayer for the model's own dtype)
    behind cache/evicting.EvictingMixin, carrying the EvictionOptions; the model's attention modules get the
    pre-hook that feeds it (once per model)."""
    options = parse_kind(kind)
    if options is None or (native(options, model.dtype) and options.eviction is None):
        return DynamicCache(config=model.config)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if options.eviction is None:
        eager = KINDS[options.name].eager
        return Cache(layers=[eager(options, **extra) for extra in layer_levels(model, options, n_layers)])
    install_hooks(model)
    if native(options, model.dtype):
        return Cache(layers=[evicting_layer(layers.DynamicLayer)(options.eviction) for _ in range(n_layers)])
    eager = evicting_layer(KINDS[options.name].eager)
    return Cache(layers=[eager(options.eviction, options=options, **extra)
                         for extra in layer_levels(model, options, n_layers)])


def bytes_per_token(config, kind: str | None, model_dtype: torch.dtype) -> int | float:
    """Compressed cache bytes one token of one sequence adds, over all layers, K and V (`kind` None = model dtype).

    KIVI's full-precision residual is excluded (see `residual_bytes`), and so are its fixed costs, sinks and
    codebooks (in `estimate_cache_bytes`); outliers are included; a float when g does not divide the group's bytes.
    """
    options = parse_kind(kind)
    if options is None:
        return float_per_token(dims(config), model_dtype)
    return KINDS[options.name].sizes.per_token(options, dims(config), model_dtype)


def residual_bytes(config, kind: str | None, batch: int, seq_len: int, model_dtype: torch.dtype) -> int:
    """Bytes of the full-precision part of a cache at `batch` × `seq_len`: KIVI's residual of (seq_len − sinks) mod
    residual_len tokens in `model_dtype`; 0 for every other kind. Sinks are not in it: they stay forever."""
    options = parse_kind(kind)
    if options is None:
        return 0
    return KINDS[options.name].sizes.residual(options, dims(config), batch, seq_len, model_dtype)


def estimate_cache_bytes(config, kind: str | None, batch: int, seq_len: int, model_dtype: torch.dtype,
                         prompt_len: int | None = None) -> int:
    """Bytes a cache of `kind` holds at `batch` × `seq_len` tokens fed; equals `cache_bytes` for llama-style models.

    With eviction, seq_len counts every token fed (prompt + generated) and `prompt_len` the prompt's, fed in one
    prefill (None: all seq_len of them): the cache holds eviction.held(prompt, generated) tokens (the kept prompt,
    plus what the decoding schedule has not compressed yet) at the kind's rate. A chunked prefill evicts per chunk
    and holds more; batches count the longest row's columns."""
    options = parse_kind(kind)
    if options is not None and options.eviction is not None:
        prompt = seq_len if prompt_len is None else min(prompt_len, seq_len)
        seq_len = options.eviction.held(prompt, seq_len - prompt)
    elif options is None or native(options, model_dtype):  # transformers' DynamicCache: windows respected
        return native_bytes(config, batch, seq_len, model_dtype)
    return KINDS[options.name].sizes.held(options, dims(config), batch, seq_len, model_dtype)
