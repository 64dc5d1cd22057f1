"""Layer 14: one bench cell measured on runner's engine, transformers, speculative and assisted decoding."""
