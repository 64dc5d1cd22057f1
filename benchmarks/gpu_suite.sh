#!/usr/bin/env bash
# The compiled engine on one GPU, in one markdown table (issue 16). First run on an H200: docs/performance.md, "GPU".
# `--smoke` runs the same steps on CPU with a tiny random model and small sizes (tests/test_gpu_suite.py).
#
#   bash benchmarks/gpu_suite.sh [OUT.md]            # on cuda:0; default OUT: runs/gpu_suite.md
#   bash benchmarks/gpu_suite.sh --smoke [OUT.md]    # CPU, tiny model: checks the suite's plumbing, not speed
# On a device machine lent to a session, whose image lacks pydantic: `bash benchmarks/device_wheels.sh` here once,
# then the device tool's run with carry [".whl"] and the command
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   PYTHONPATH=/tmp/site PYTHON=python3 bash benchmarks/gpu_suite.sh $OUT/gpu_suite.md
#
# Measures, on cuda:0, in bf16:
#   1. decode vs transformers eager (hf) and transformers' static cache + compile (hf-compiled), Qwen2.5-Coder 0.5B
#      and 1.5B, batch 1, 8 and 32, with the fraction of the measured device-copy bandwidth (bw);
#   2. every static cache kind at 4k and 16k tokens of context, compiled engine, ratio to fp16 (Qwen 0.5B);
#   3. speculative decoding with the Qwen pair (0.5B drafts for 1.5B), compiled engine, vs target-only and hf.
# Models: the zoo's Qwen pair where its weights are converted in ~/.cache/runner already; elsewhere random models of
# the same shapes (benchmarks/shapes/*.json: decode speed depends on shapes, not on the weights' values). A device
# machine that reaches no registry gets its files from the working tree, 64 MiB a call: 1.6 GB of weights cannot
# travel, so there the shapes stand in. Speculative decoding needs the real pair (acceptance depends on the
# weights): without it that step is skipped, and the table says so.
# Budget: on a bare H200 each shape compiles in 26-54 s (5-7 s with inductor's cache warm), so the whole suite takes
# well over 15 minutes: split it across device calls (LIMIT=300 per script) or trim it from the environment:
# BATCHES, CONTEXTS, KINDS (space-separated, as below), REPEATS, DECODE=small (the 0.5B model alone), and
# CONTEXTS="" or BATCHES="" to leave out the kinds' or the decode rows. Compile seconds
# are printed on their own lines and cached under ~/.cache/runner/inductor. Each script also prints its own table; the suite's table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT=${1:-runs/gpu_suite.md}
PY=${PYTHON:-python}
export HF_HUB_OFFLINE=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if (( SMOKE )); then
  DEVICE=cpu DTYPE=float32 BATCHES="1 2" CONTEXTS="64" KINDS="fp16 q8_0" STEPS=4 TOKENS=4 REPEATS=1 LIMIT=600
  SMALL=benchmarks/shapes/tiny-qwen2.json LARGE=benchmarks/shapes/tiny-qwen2.json DECODE_MODELS=$SMALL
  SPEC_ARGS=(--target "$LARGE" --draft "$SMALL")
else
  DEVICE=cuda DTYPE=bfloat16 BATCHES=${BATCHES-"1 8 32"} CONTEXTS=${CONTEXTS-"4096 16384"}
  KINDS=${KINDS:-"bf16 fp16 q8_0 q4_0 q4_1 nf4 kivi4 kivi2"} STEPS=64 TOKENS=128 REPEATS=${REPEATS:-5} LIMIT=${LIMIT:-240}
  source_of() {  # the zoo model when it is here, else a random model of its shape
    if "$PY" -c "import sys; from runner.infer.loading.zoo import zoo_cached; sys.exit(not zoo_cached('zoo:$1'))"; then
      echo "zoo:$1"; else echo "benchmarks/shapes/$1.json"; fi
  }
  SMALL=$(source_of qwen2.5-coder-0.5b) LARGE=$(source_of qwen2.5-coder-1.5b)
  DECODE_MODELS=$( [[ "${DECODE:-both}" == small ]] && echo "$SMALL" || echo "$SMALL $LARGE")
  SPEC_ARGS=()
  [[ "$SMALL" == zoo:* && "$LARGE" == zoo:* ]] && SPEC_ARGS=(--target "$LARGE" --draft "$SMALL")
fi
mkdir -p "$(dirname "$OUT")"
{
  if [[ "$DEVICE" == cuda ]]; then machine=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  else machine=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | xargs); fi
  echo "GPU suite$( (( SMOKE )) && echo ' (smoke, CPU)'): $machine, $(date -u +%F), commit $(git rev-parse --short HEAD)"
  echo
  echo "| benchmark | model | dtype | batch | context | variant | decode tok/s | spread | ÷hf | ÷hf-compiled | ÷fp16 | bw | same tokens as hf |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$OUT"
start=$(date +%s)
for model in ${BATCHES:+$DECODE_MODELS}; do
  timeout "$LIMIT" "$PY" benchmarks/compiled_vs_hf.py --model "$model" --device "$DEVICE" --dtypes "$DTYPE" \
    --batch-sizes $BATCHES --new-tokens "$TOKENS" --repeats "$REPEATS" --variants compiled hf hf-compiled \
    --markdown "$OUT" || echo "compiled_vs_hf on $model stopped (exit $?; rows so far are kept)"
done
for context in $CONTEXTS; do
  timeout "$LIMIT" "$PY" benchmarks/compiled_kinds.py --model "$SMALL" --device "$DEVICE" --dtype "$DTYPE" \
    --context "$context" --steps "$STEPS" --repeats "$REPEATS" --engines compiled --kinds $KINDS --markdown "$OUT" \
    || echo "compiled_kinds at $context stopped (exit $?; rows so far are kept)"
done
if (( ${#SPEC_ARGS[@]} )); then
  timeout "$LIMIT" "$PY" benchmarks/speculative.py "${SPEC_ARGS[@]}" --dtype "$DTYPE" --device "$DEVICE" \
    --engine compiled --k 4 --batch $BATCHES --new-tokens "$TOKENS" --repeats "$REPEATS" --hf --markdown "$OUT" || echo "speculative stopped (exit $?)"
else
  echo "| speculative | $LARGE ← $SMALL | $DTYPE | - | - | skipped: the Qwen pair's weights are not on this machine | - | - | - | - | - | - | - |" >> "$OUT"
fi
echo
echo "suite took $(( $(date +%s) - start )) s"
echo
cat "$OUT"
