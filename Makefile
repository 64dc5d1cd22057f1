# Set-up is idempotent: both targets create .venv and install runner into it when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1

.PHONY: quickstart test test-cluster setup bench clean

quickstart: setup
	$(BIN)/run manifests/quickstart.yaml

test: setup
	$(BIN)/python -m pytest -q

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

bench: setup
	$(BIN)/python benchmarks/decode_vs_hf.py

clean:
	rm -rf $(VENV) runs
