"""Layer 8: long-context tasks (RULER's synthetic suite, generated offline and seeded), their scoring and their
evaluation through the forward chain on any cache kind."""
