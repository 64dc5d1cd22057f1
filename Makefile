# Set-up is idempotent: both targets create .venv and install runner into it when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: quickstart test test-fast lint cpu test-cluster setup setup-llamacpp bench clean

quickstart: setup
	$(BIN)/run manifests/quickstart.yaml

# The whole suite (what CI runs). Tiers (pyproject.toml's markers): slow = a real model from the zoo (or building
# the package), compile = torch.compile of real shapes, gpu = needs CUDA (skipped without it).
test: setup
	$(BIN)/python -m pytest -q -n auto --dist load --durations=25

# Everyday work: the suite without slow, compile, gpu and e2e tests (time: see docs/performance.md).
test-fast: setup
	$(BIN)/python -m pytest -q -n auto --dist load -m "not slow and not compile and not gpu and not e2e"

# Lint and import order (ruff) and types (mypy) on runner/, configured in pyproject.toml; CI runs it first.
lint: setup
	$(BIN)/ruff check runner tests benchmarks hydra_plugins cluster
	$(BIN)/mypy

# The CPU the tests run on: its model and the vector extensions runner's kernels and aten choose paths by.
cpu:
	@grep -m1 '^model name' /proc/cpuinfo 2>/dev/null || uname -m
	@$(BIN)/python -c "from runner.infer.kernels.native import vector_flags; print('vector extensions:', ' '.join(vector_flags()))"
	@$(BIN)/python -c "import torch; print('aten CPU capability:', torch.backends.cpu.get_cpu_capability())" 2>/dev/null || true
	@$(BIN)/python -c "from runner.infer.kernels import gguf_rows; print('runner GGUF kernel paths:', ', '.join(gguf_rows.paths().values()) or 'none (no compiler: see the warning)')" 2>/dev/null || true

# Sweeps on real clusters on this machine (Ray, SLURM, submitit local, an MLflow server, the UI in chromium):
# docs/clusters.md. Needs root; 6-11 minutes on 2 cores once installed (bounded at 30).
test-cluster: setup
	$(BIN)/pip install -q -e ".[cluster]"
	bash cluster/test_cluster.sh

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev]"
	# Ray's launcher plugin alone (its config, for the test that manifests/launchers/ray.yaml composes):
	# its dependency ray[default] is hundreds of MB; install the `ray` extra to launch on a Ray cluster.
	$(BIN)/pip install -q --no-deps "hydra-ray-launcher>=1.2,<1.3"
	touch $@

# engine: llama.cpp (docs/engines.md): llama-cpp-python's pinned sdist (sha256-checked) built once into a wheel cached
# per CPU under ~/.cache/runner/wheels/ (llama.cpp compiles with -march=native: minutes), then installed; a no-op after.
setup-llamacpp: setup
	$(BIN)/python -m runner.infer.llamacpp.install

bench: setup
	$(BIN)/python benchmarks/decode_vs_hf.py

clean:
	rm -rf $(VENV) runs
