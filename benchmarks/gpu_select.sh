#!/usr/bin/env bash
# Select's kernels alone on the GPU (device tool, one call, fits an H100): their GPU tests, then
# benchmarks/bench_select.py at a decode step's shapes:
#   --quest QUEST (default "4x131072 1x131072"): Quest's whole Select of a 32-layer step, the
#       separate steps against the fused kernel and the two-level Select at each GP:FACTOR of
#       COARSE (default "16:4 16:2 8:4"), eager and replayed from a CUDA graph, with the two-level
#       Select's recall of Quest's pages (random bounds: no locality, a floor);
#   the ragged top-k alone (whole-row and split-row) at 128K for each of BATCHES
#       (default "4 1").
#   SPIN_COMMIT=<sha> bash benchmarks/gpu_select.sh
# Results in $OUT: select.log, quest/bench_select_quest.json, ragged-b<B>/bench_select.json.
# BASELINE_KERNELS=DIR: first the same Quest timing with the kernels/ folder DIR (another commit's,
# carried: `mkdir -p .carry/k0 && git archive <sha> kernels | tar -x -C .carry/k0`, then
# BASELINE_KERNELS=.carry/k0/kernels), so that a kernel change's before and after run in one call
# on one machine; in $OUT/quest-baseline. Its kernels must fit this commit's Python wrappers.
set -o pipefail
source benchmarks/gpu_setup.sh
LOG="$OUT/select.log"
gpu_record "$LOG"
echo "commit ${SPIN_COMMIT:-unknown}" | tee -a "$LOG"
(cd /tmp && timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$REPO/tests/kernels/test_coarse_select.py" \
  "$REPO/tests/kernels/test_quest_select.py" "$REPO/tests/kernels/test_page_select.py" 2>&1 | tail -12) | tee -a "$LOG"
if [ -n "$BASELINE_KERNELS" ]; then
  rm -rf "$PKG-baseline" && cp -r "$PKG" "$PKG-baseline" && rm -rf "$PKG-baseline/spin_cluster/kernels"
  cp -r "$BASELINE_KERNELS" "$PKG-baseline/spin_cluster/kernels"
  echo "== the baseline kernels ($BASELINE_KERNELS)" | tee -a "$LOG"
  # shellcheck disable=SC2086
  PYTHONPATH=$PKG-baseline:/tmp/site:/tmp/gguf timeout 300 python3 benchmarks/bench_select.py --quest ${QUEST:-4x131072 1x131072} \
    --coarse ${COARSE:-16:4 16:2 8:4} --out "$OUT/quest-baseline" 2>&1 | tee -a "$LOG"
  echo "== this commit's kernels" | tee -a "$LOG"
fi
# shellcheck disable=SC2086
timeout 300 python3 benchmarks/bench_select.py --quest ${QUEST:-4x131072 1x131072} --coarse ${COARSE:-16:4 16:2 8:4} \
  --out "$OUT/quest" 2>&1 | tee -a "$LOG"
for b in ${BATCHES:-4 1}; do
  timeout 150 python3 benchmarks/bench_select.py --context 131072 --batch "$b" --warps 16 --out "$OUT/ragged-b$b" 2>&1 | tee -a "$LOG"
done
