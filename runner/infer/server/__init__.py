"""Layer 14: the OpenAI-compatible HTTP server over the serve layer's scheduler (docs/serve.md, "run serve")."""
