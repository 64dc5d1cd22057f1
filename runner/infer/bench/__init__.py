"""Layer 15: one bench cell measured on runner's engine, transformers, speculative and assisted decoding."""
