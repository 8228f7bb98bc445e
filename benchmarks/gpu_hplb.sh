#!/usr/bin/env bash
# S-HPLB head placement on the GPU (device tool, one call, ~2 minutes on an H200): the
# head-parallel GPU test (one NCCL rank), then benchmarks/bench_hplb_makespan.py at Llama-3.1-8B
# attention shapes and 128K tokens. Results land in $OUT. Optional: HPLB_BUDGETS=path/to/
# budgets.json (a [layers][KV heads] profile, stretched to 32 x 8) instead of the synthetic one.
set -o pipefail
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
(cd /tmp && timeout 120 python3 -m pytest "$REPO/tests/parallel" -m gpu -q -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/hplb_gpu_tests.log"
timeout 240 python3 -P -m spin_cluster.bench hplb-makespan --context 131072 --batch 32 --ranks 2 4 8 \
  ${HPLB_BUDGETS:+--budgets "$HPLB_BUDGETS"} \
  --out "$OUT/hplb_makespan.json" --md "$OUT/hplb_makespan.md" 2>&1 | grep -v '%|' | tee "$OUT/hplb_makespan.log"
