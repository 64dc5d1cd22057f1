"""Layer 12: speculative decoding: the round's arithmetic, drafts through text, batched rounds, the generator."""
