#!/usr/bin/env bash
# The foundation's GPU run (device tool, one call): GPU tests, engine vs transformers speed,
# paged-decode kernel speed. Results land in $OUT.
set -o pipefail
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)" | tee -a "$OUT/gpu.txt"
(cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
(cd /tmp && timeout 240 python3 -m pytest "$REPO/tests/kernels" "$REPO/tests/engine/test_engine_gpu.py" -m gpu -q -p no:cacheprovider -p no:randomly 2>&1 | tail -15) | tee "$OUT/gpu_tests.log"
timeout 240 python3 -P -m spin_cluster.bench generate-speed --model /tmp/models/SmolLM2-135M-Instruct --out "$OUT/generate_speed.json" 2>&1 | grep -v "it/s" | tee "$OUT/generate_speed.log"
timeout 120 python3 -P -m spin_cluster.bench paged-decode 2>&1 | tee "$OUT/paged_decode.log"
