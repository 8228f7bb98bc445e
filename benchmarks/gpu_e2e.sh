#!/usr/bin/env bash
# The end-to-end run (device tool, one call, within 10 minutes on one H200): GPU tests of the
# decode CUDA graphs and the engine, then benchmarks/e2e.py at Llama-3.1-8B shapes with the
# KV over a GPU cap (GPU_KV_GIB, default 24; a 128K request's KV is 16 GiB). The host tier is
# 3/4 of the memory this machine lets us pin (probed first, 8 GiB at a time, at most 72 GiB;
# HOST_KV_GIB sets it), and the offline batch is what that tier holds at 128K (at most 6). The tokenizer comes from
# .carry/tok when carried, else from the prepared default model. Results land in $OUT:
# gpu.txt, gpu_tests.log, e2e.{json,md,png,log}. Env: MODES, WORKLOADS (subsets), HOST_KV_GIB (skip the
# probe), DEADLINE_S, GPU_TESTS=0, MAX_BATCHED (prefill chunk), EXTRA_ARGS (more e2e.py flags).
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_record
if [ "${GPU_TESTS:-1}" = 1 ]; then
  (cd /tmp && timeout 120 python3 -m pytest "$REPO/tests/engine/test_cuda_graphs.py" "$REPO/tests/engine/test_engine_gpu.py" \
    "$REPO/tests/engine/test_spin_graphs.py" "$REPO/tests/engine/test_spin_gpu.py" "$REPO/tests/kernels/test_buffer_lookup.py" \
    "$REPO/tests/kernels/test_layer_ops.py" "$REPO/tests/kernels/test_lookup_epilogue.py" "$REPO/tests/sparse/test_labels.py" \
    -m gpu -q -p no:cacheprovider 2>&1 | tail -12) | tee "$OUT/gpu_tests.log"
fi
PIN=${HOST_KV_GIB:+$(( HOST_KV_GIB * 4 / 3 ))}
[ -n "$PIN" ] || PIN=$(python3 - <<'PY'
import torch
bufs = []
try:
    while len(bufs) < 12:
        bufs.append(torch.empty(8 * 2**30, dtype=torch.uint8, pin_memory=True))
except Exception:
    pass
print(8 * len(bufs))
PY
)
HOST=$(( PIN * 3 / 4 )); [ "$HOST" -gt 72 ] && HOST=72
[ -n "$HOST_KV_GIB" ] && HOST=$HOST_KV_GIB  # as given: e.g. 88 GiB holds 5 requests of 128K
BATCH=$(( HOST / 17 )); [ "$BATCH" -gt 6 ] && BATCH=6; [ "$BATCH" -lt 1 ] && BATCH=1
echo "pinnable host memory: >= $PIN GiB; host tier $HOST GiB; offline batch $BATCH" | tee -a "$OUT/gpu.txt"
MODES_ARG=(); [ -n "$MODES" ] && MODES_ARG=(--modes $MODES)
WL_ARG=(); [ -n "$WORKLOADS" ] && WL_ARG=(--workloads $WORKLOADS)
timeout 545 python3 -P -m spin_cluster.bench e2e "${MODES_ARG[@]}" "${WL_ARG[@]}" --gpu-kv-gib "${GPU_KV_GIB:-24}" --host-kv-gib "$HOST" --offline-batch "$BATCH" \
  --deadline-s "${DEADLINE_S:-470}" \
  ${MAX_BATCHED:+--max-batched-tokens $MAX_BATCHED} ${EXTRA_ARGS} "${TOK[@]}" --out "$OUT" 2>&1 | tee "$OUT/e2e.log"
