"""Layer 4: what comes from disk or a pinned download: models, the zoo, evaluation texts."""
