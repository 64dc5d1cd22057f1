"""The manifest front end, without torch: safe YAML with locations, Hydra composition, the pydantic schema,
located problems, input files, and the step plan a manifest resolves to."""
