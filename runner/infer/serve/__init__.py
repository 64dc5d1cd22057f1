"""Layer 12: serving under load: requests that arrive over time, a continuous-batching scheduler, what each
request saw."""
