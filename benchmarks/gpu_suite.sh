#!/usr/bin/env bash
# The compiled engine on one GPU, in one markdown table (issue 16). NOT YET RUN: written without a GPU.
#
#   bash benchmarks/gpu_suite.sh [OUT.md]        # default: runs/gpu_suite.md
#
# Measures, on cuda:0, in bf16:
#   1. decode vs transformers eager (hf) and transformers' static cache + compile (hf-compiled), Qwen2.5-Coder 0.5B
#      and 1.5B (zoo), batch 1, 8 and 32, with the fraction of the measured device-copy bandwidth (bw);
#   2. every static cache kind at 4k and 16k tokens of context, compiled engine, ratio to fp16 (Qwen 0.5B);
#   3. speculative decoding with the Qwen pair (0.5B drafts for 1.5B), compiled engine, vs target-only and hf.
# Budget: under 8 minutes on an H100-class GPU once the models are in ~/.cache/runner (first loads from GGUF take
# 15-50 s each); compile seconds are printed on their own lines and cached under ~/.cache/runner/inductor.
# Each script also prints its own table; the suite's table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_suite.md}
PY=${PYTHON:-python}
mkdir -p "$(dirname "$OUT")"
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-.}
{
  echo "GPU suite: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), commit $(git rev-parse --short HEAD)"
  echo
  echo "| benchmark | model | dtype | batch | context | variant | decode tok/s | spread | ÷hf | ÷hf-compiled | ÷fp16 | bw | same tokens as hf |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$OUT"
start=$(date +%s)
for model in zoo:qwen2.5-coder-0.5b zoo:qwen2.5-coder-1.5b; do
  timeout 240 "$PY" benchmarks/compiled_vs_hf.py --model "$model" --device cuda --dtypes bfloat16 \
    --batch-sizes 1 8 32 --new-tokens 128 --repeats 5 --variants compiled hf hf-compiled --markdown "$OUT"
done
for context in 4096 16384; do
  timeout 150 "$PY" benchmarks/compiled_kinds.py --model zoo:qwen2.5-coder-0.5b --device cuda --dtype bfloat16 \
    --context "$context" --steps 64 --repeats 5 --engines compiled --kinds bf16 fp16 q8_0 q4_0 q4_1 nf4 kivi4 kivi2 \
    --markdown "$OUT"
done
timeout 120 "$PY" benchmarks/speculative.py --target zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b \
  --dtype bfloat16 --device cuda --engine compiled --k 4 --new-tokens 128 --repeats 3
echo
echo "suite took $(( $(date +%s) - start )) s"
echo
cat "$OUT"
