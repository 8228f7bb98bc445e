#!/usr/bin/env bash
# The kernels on the GPU without a model (device tool; fits a call, or runs in the background
# while a model is carried): every GPU test (those needing the default model skip without its
# GGUF), check_spin_tokens (Spin's data path gives dense's tokens; toy shapes, random weights,
# the tokenizer from .carry/tok), then the Select bench, with BASELINE_KERNELS (another commit's
# kernels/, carried) timed first in the same run. Results in $OUT: gpu_tests.log,
# check_spin_tokens.{json,log}, select.log, quest*/, ragged-b*/.
# Env: TESTS_TIMEOUT (s, default 300), and gpu_select.sh's QUEST, COARSE, BATCHES, BASELINE_KERNELS.
set -o pipefail
TESTS_TIMEOUT=${TESTS_TIMEOUT:-300} bash benchmarks/gpu_tests.sh
source benchmarks/gpu_setup.sh
echo "commit ${SPIN_COMMIT:-unknown}" > "$OUT/check_spin_tokens.log"
timeout 240 python3 -P -m spin_cluster.bench check-spin-tokens "${TOK[@]}" --out "$OUT/check_spin_tokens.json" \
  2>&1 | tail -12 | tee -a "$OUT/check_spin_tokens.log"
bash benchmarks/gpu_select.sh
