"""Layer 1, torch-free: the settings and grammars the manifest shares with the library (dtypes, cache kinds
and their options, weight quantizations, decoding settings)."""
