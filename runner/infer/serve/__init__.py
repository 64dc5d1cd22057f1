"""Layer 13: serving under load: requests arriving over time, a continuous-batching scheduler, what each saw."""
