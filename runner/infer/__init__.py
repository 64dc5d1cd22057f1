"""The inference library: load models, decode, sample. Knows nothing of manifests.

Usable on its own, the way the seed guide shows it::

    from runner.infer import Generator, GenerateConfig, generate
    out = generate(model, input_ids, config=GenerateConfig(max_new_tokens=32, temperature=0))

Names are imported lazily so that `runner.infer.config` (no torch) stays cheap to import.
"""

from importlib import import_module

_EXPORTS = {
    "GenerateConfig": "runner.infer.config",
    "Generator": "runner.infer.generation.generator",
    "generate": "runner.infer.generation.generator",
    "load_model": "runner.infer.loading.models",
    "make_cache": "runner.infer.cache.registry",
    "select_cache_kind": "runner.infer.select.autocache",
    "decide_cache_kind": "runner.infer.select.decide",
    "SpeculativeConfig": "runner.infer.config",
    "SpeculativeGenerator": "runner.infer.speculative.generator",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runner.infer' has no attribute {name!r}")
