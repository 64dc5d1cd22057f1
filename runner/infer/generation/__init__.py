"""Layer 10: the Generator, the seed API's front door to decoding."""
