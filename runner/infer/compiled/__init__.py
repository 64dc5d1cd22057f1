"""Layer 9: the compiled engine: static decode state, attention that reads the cache in place, one compiled
step per shape."""
