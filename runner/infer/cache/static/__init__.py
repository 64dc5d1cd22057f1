"""Preallocated caches for the compiled engine, each layer with the `attend` the CPU kernel reads it by."""
