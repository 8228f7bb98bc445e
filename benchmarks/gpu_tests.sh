#!/usr/bin/env bash
# Every GPU test that the benchmarks/gpu_*.sh scripts select, in one run: `-m gpu` over the
# union of their test paths, so that a log shows what each script's selection does on the
# GPU (device tool, repo root; the default model's GGUF carried as .carry/p*/gguf.part*):
#   SPIN_COMMIT=<sha> bash benchmarks/gpu_tests.sh
# Writes $OUT/gpu_tests.log: the GPU, then pytest's summary (failures and skips with reasons).
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_record "$OUT/gpu_tests.log"
echo "commit ${SPIN_COMMIT:-unknown}" | tee -a "$OUT/gpu_tests.log"
(cd /tmp && timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  "$REPO/tests/kernels" "$REPO/tests/kvcache" "$REPO/tests/parallel" \
  "$REPO/tests/engine/test_engine_gpu.py" "$REPO/tests/engine/test_spin_gpu.py" "$REPO/tests/engine/test_cuda_graphs.py" \
  "$REPO/tests/engine/test_spin_graphs.py" "$REPO/tests/engine/test_gemma_spin.py" "$REPO/tests/engine/test_async_decode.py" \
  "$REPO/tests/sparse/test_labels.py" \
  "$REPO/tests/sparse/test_sparse_prefill.py" \
  2>&1 | tail -40) | tee -a "$OUT/gpu_tests.log"
