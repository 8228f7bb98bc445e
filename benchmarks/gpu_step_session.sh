#!/usr/bin/env bash
# The decode step on an H100 in one background job (benchmarks/gpu_background.sh): the pinned
# host tier's test, then the equal-memory runs at the H100's shapes (gpu_equal_memory.sh's
# h100-* and labels-h100-* runs: 8 x 32K and 2 x 128K in 40 GiB each, dense beside Spin),
# then the step's profile at 2 x 128K for dense, two-level Quest and the bundled config's
# labels (kernels a layer, Select's share of the sparse attention). Results in $OUT:
# pinned_tier.log, e2e-<run>.{json,md}, equal_memory.log, profile-*.json, profile.log.
# Env: RUNS (gpu_equal_memory.sh's), PINNED (default 1; 0: no test), CHECKS (default 0; 1: the
# GPU tests of Select's kernels and the labels path, and check_spin_tokens, first: checks.log,
# check_spin_tokens.json), PROFILE_MODES (default "dense spin"; empty: only the labels profile)
# at 128K, PROFILE_BATCH (2) requests in PROFILE_GIB (40); LABELS_PROFILE (default 1).
set -o pipefail
source benchmarks/gpu_setup.sh
if [ "${CHECKS:-0}" = 1 ]; then
  gpu_record "$OUT/checks.log"
  echo "commit ${SPIN_COMMIT:-unknown}" | tee -a "$OUT/checks.log"
  (cd /tmp && timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$REPO/tests/sparse/test_labels.py" \
    "$REPO/tests/kernels/test_page_select.py" "$REPO/tests/kernels/test_buffer_lookup.py" \
    "$REPO/tests/engine/test_spin_graphs.py" 2>&1 | tail -15) | tee -a "$OUT/checks.log"
  timeout 240 python3 -P -m spin_cluster.bench check-spin-tokens "${TOK[@]}" --out "$OUT/check_spin_tokens.json" \
    2>&1 | tail -12 | tee -a "$OUT/checks.log"
fi
if [ "${PINNED:-1}" = 1 ]; then
  echo "commit ${SPIN_COMMIT:-unknown}" | tee "$OUT/pinned_tier.log"
  (cd /tmp && timeout 180 python3 -m pytest "$REPO/tests/kvcache/test_host_tier_pinned.py" -m gpu -q -s \
    -p no:cacheprovider -rfEs 2>&1 | tail -12) | tee -a "$OUT/pinned_tier.log"
fi
SELECT=0 RUNS="${RUNS:-h100-32k labels-h100-32k h100-128k labels-h100-128k}" bash benchmarks/gpu_equal_memory.sh
modes=${PROFILE_MODES-dense spin}
common=(CONTEXT=131072 BATCH=${PROFILE_BATCH:-2} GPU_KV_GIB=${PROFILE_GIB:-40} STEPS=10)
[ -n "$modes" ] && env "${common[@]}" MODES="$modes" EXTRA_ARGS="--coarse-pages 16" bash benchmarks/gpu_decode_step.sh
[ "${LABELS_PROFILE:-1}" = 1 ] || exit 0
mkdir -p "$OUT/labels" && env "${common[@]}" MODES=spin OUT="$OUT/labels" \
  EXTRA_ARGS="--algorithm labels --resident-margin 0.5 --sparse-option index_dtype=float8_e4m3fn" \
  bash benchmarks/gpu_decode_step.sh
