#!/usr/bin/env bash
# The memory system's GPU run (device tool, one call): GPU tests of the offloaded path and
# the kernels, then benchmarks/memory.py. Results land in $OUT.
set -o pipefail
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
(cd /tmp && timeout 300 python3 -m pytest "$REPO/tests/engine/test_spin_gpu.py" "$REPO/tests/engine/test_engine_gpu.py" "$REPO/tests/kvcache" "$REPO/tests/kernels" -m gpu -q -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/gpu_tests.log"
timeout 200 python3 -P -m spin_cluster.bench memory --out "$OUT/memory.json" --md "$OUT/memory.md" 2>&1 | tail -40 | tee "$OUT/memory.log"
