#!/usr/bin/env bash
# The decode step on an H100 in one background job (benchmarks/gpu_background.sh): the pinned
# host tier's test, then the equal-memory runs at the H100's shapes (gpu_equal_memory.sh's
# h100-* and labels-h100-* runs: 8 x 32K and 2 x 128K in 40 GiB each, dense beside Spin),
# then the step's profile at 2 x 128K for dense, two-level Quest and the bundled config's
# labels (kernels a layer, Select's share of the sparse attention). Results in $OUT:
# pinned_tier.log, e2e-<run>.{json,md}, equal_memory.log, profile-*.json, profile.log.
# Env: RUNS (gpu_equal_memory.sh's), PINNED (default 1; 0: no test), PROFILE_MODES (default
# "dense spin"; empty: no profiles) at 128K, PROFILE_BATCH (2) requests in PROFILE_GIB (40).
set -o pipefail
source benchmarks/gpu_setup.sh
if [ "${PINNED:-1}" = 1 ]; then
  echo "commit ${SPIN_COMMIT:-unknown}" | tee "$OUT/pinned_tier.log"
  (cd /tmp && timeout 180 python3 -m pytest "$REPO/tests/kvcache/test_host_tier_pinned.py" -m gpu -q -s \
    -p no:cacheprovider -rfEs 2>&1 | tail -12) | tee -a "$OUT/pinned_tier.log"
fi
SELECT=0 RUNS="${RUNS:-h100-32k labels-h100-32k h100-128k labels-h100-128k}" bash benchmarks/gpu_equal_memory.sh
modes=${PROFILE_MODES-dense spin}
[ -n "$modes" ] || exit 0
common=(CONTEXT=131072 BATCH=${PROFILE_BATCH:-2} GPU_KV_GIB=${PROFILE_GIB:-40} STEPS=10)
env "${common[@]}" MODES="$modes" EXTRA_ARGS="--coarse-pages 16" bash benchmarks/gpu_decode_step.sh
mkdir -p "$OUT/labels" && env "${common[@]}" MODES=spin OUT="$OUT/labels" \
  EXTRA_ARGS="--algorithm labels --resident-margin 0.5 --sparse-option index_dtype=float8_e4m3fn" \
  bash benchmarks/gpu_decode_step.sh
