"""Layer 6: KV caches of every kind, as transformers cache layers (eager) and preallocated (static/); the
decode plan's sliding window; ragged rows."""
