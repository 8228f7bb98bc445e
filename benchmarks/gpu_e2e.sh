#!/usr/bin/env bash
# The end-to-end run (device tool, one call, within 10 minutes on one H200): GPU tests of the
# decode CUDA graphs and the engine, then benchmarks/e2e.py at Llama-3.1-8B shapes with the
# KV over a 24 GiB GPU cap (a 128K request's KV is 16 GiB). Results land in $OUT:
# gpu.txt, gpu_tests.log, e2e.{json,md,png,log}.
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_info
(cd /tmp && timeout 50 python3 -m pytest "$REPO/tests/engine/test_cuda_graphs.py" "$REPO/tests/engine/test_engine_gpu.py" \
  -m gpu -q -p no:cacheprovider 2>&1 | tail -8) | tee "$OUT/gpu_tests.log"
timeout 545 python3 benchmarks/e2e.py --gpu-kv-gib 24 --deadline-s 470 --out "$OUT" 2>&1 | tee "$OUT/e2e.log"
