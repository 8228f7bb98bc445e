#!/usr/bin/env bash
# Head-parallel decode on the GPUs of one host (device tool, nvidia-h200-x2/-x4/-x8, one call):
# the NCCL GPU tests of spin_cluster.parallel, then benchmarks/bench_head_parallel.py at
# Llama-3.1-8B shapes in bf16 (128K context by default; CONTEXT, BATCH, STEPS, RANKS
# override), then the same sweep in float32 at FP32_CONTEXT tokens (8K; 0 skips it), where
# greedy tokens of random weights are not near ties, for the token check. NVLink multicast
# stays off. TESTS=0 skips the tests, CONTEXT=0 the bf16 sweep: at 128K each configuration
# takes about 75 s (its prefill 50 s), so on four GPUs the two sweeps fit one 10-minute call
# each. The tokenizer comes from .carry/tok when carried. Results in $OUT (8 files at most):
# gpu.txt, parallel_gpu_tests.log, head_parallel{,-fp32}.{json,md,log}.
set -o pipefail
export NCCL_NVLS_ENABLE=0
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
TOK=()
if [ -f .carry/tok/tokenizer.json ]; then
  TOK=(--tokenizer "$REPO/.carry/tok")
  # the tests' tiny models borrow the default model's tokenizer: a stand-in prepared folder
  M=$SPIN_MODEL_DIR/SmolLM2-135M-Instruct; mkdir -p "$M"; cp .carry/tok/* "$M/"; touch "$M/model.safetensors"
fi
if [ "${TESTS:-1}" != 0 ]; then
  (cd /tmp && timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest "$REPO/tests/parallel" -m gpu -q -p no:cacheprovider 2>&1 | tail -8) \
    | tee "$OUT/parallel_gpu_tests.log"
fi
if [ "${CONTEXT:-131072}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 -P -m spin_cluster.bench head-parallel --ranks ${RANKS:-1 2 4 8} \
    --context "${CONTEXT:-131072}" --batch "${BATCH:-2}" --steps "${STEPS:-32}" --timeout-s "${CONFIG_TIMEOUT:-150}" \
    "${TOK[@]}" --out "$OUT/head_parallel.json" --md "$OUT/head_parallel.md" 2>&1 | tee "$OUT/head_parallel.log"
fi
if [ "${FP32_CONTEXT:-8192}" != 0 ]; then
  timeout "${FP32_TIMEOUT:-200}" python3 -P -m spin_cluster.bench head-parallel --ranks ${RANKS:-1 2 4 8} --dtype float32 \
    --context "${FP32_CONTEXT:-8192}" --batch "${BATCH:-2}" --steps 24 --budget 512 --timeout-s 90 "${TOK[@]}" \
    --out "$OUT/head_parallel-fp32.json" --md "$OUT/head_parallel-fp32.md" 2>&1 | tee "$OUT/head_parallel-fp32.log"
fi
