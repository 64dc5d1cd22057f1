"""Layer 5: the decode chain over an explicit state (prefill, one token at a time) and the strategies that
pick tokens: sampling, beam search, contrastive search."""
