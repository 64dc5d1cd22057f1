"""Running a step plan: the executor (run folder, MLflow runs, failure policy, resume), tracking, sweeps,
and reading results back."""
