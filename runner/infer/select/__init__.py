"""Layer 10: choosing a cache kind (and weights) for a budget: speed per kind, gates, the persisted cache plans."""
