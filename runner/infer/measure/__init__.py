"""Layer 7: the one timing harness and the quality measures (ΔNLL, PPL ratio, KL, needle probes)."""
