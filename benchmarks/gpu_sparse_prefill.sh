#!/usr/bin/env bash
# Block-sparse prefill on the GPU (device tool, one call, about 5 minutes on an H200): the
# kernel's GPU tests at full size (-m gpu: the other tests run Triton's CPU interpreter), the 32K/64K/128K timing table with the head-parallel makespan, TTFT of one
# 32K and one 128K prompt (random weights at Llama-3.1-8B shapes), and the SmolLM2 accuracy of
# sparse prefill at 4K and 8K. Results land in $OUT.
set -o pipefail
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)" | tee -a "$OUT/gpu.txt"
(cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
(cd /tmp && timeout 120 python3 -m pytest "$REPO/tests/kernels/test_block_sparse_prefill.py" "$REPO/tests/sparse/test_sparse_prefill.py" \
  -m gpu -q -p no:cacheprovider 2>&1 | tail -8) | tee "$OUT/sparse_prefill_tests.log"
timeout 150 python3 benchmarks/bench_sparse_prefill.py kernel --out "$OUT/sparse_prefill_kernel.json" 2>&1 \
  | tee "$OUT/sparse_prefill_kernel.log"
timeout 150 python3 benchmarks/bench_sparse_prefill.py ttft --out "$OUT/sparse_prefill_ttft.json" 2>&1 \
  | tee "$OUT/sparse_prefill_ttft.log"
timeout 200 python3 benchmarks/bench_sparse_prefill.py accuracy --out "$OUT/sparse_prefill_accuracy.json" 2>&1 \
  | grep -v "it/s" | tee "$OUT/sparse_prefill_accuracy.log"
