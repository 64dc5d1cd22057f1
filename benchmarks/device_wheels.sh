#!/usr/bin/env bash
# The packages benchmarks/gpu_suite.sh needs that the device machine's image lacks or has too old: pydantic and what
# it needs, and transformers (the image's 5.17 fails runner's cache tests; pyproject.toml's floor is the version
# tested). As CPython 3.12 manylinux wheels in .whl/ (git-ignored), at the versions of this checkout's .venv, for the
# device tool's `carry`. Torch (2.11 there) is too big to carry: its compiled quantized writes are not exact
# (docs/performance.md, "GPU").
# The whole run: docs/performance.md, "GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && { grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"; }
pins=$("$PY" -m pip list --format=freeze | grep -i -E "^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|transformers)==")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $pins
ls .whl
