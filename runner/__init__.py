"""runner: a declarative experiment runner for LLM inference."""

__version__ = "0.1.0"
