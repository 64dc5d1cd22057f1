"""Layer 11: the Generator, the seed API's front door to decoding."""
