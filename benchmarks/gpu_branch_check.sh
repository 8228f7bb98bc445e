#!/usr/bin/env bash
# A branch against this tree on one GPU, in one job (benchmarks/gpu_background.sh): the branch
# arrives as a patch, made here with
#   mkdir -p .carry/branch && git diff main...BRANCH > .carry/branch/patch
# and applied to a copy of this tree; the branch's GPU tests (TESTS) and check_spin_tokens run
# there; then the decode step (spin-cluster bench decode-step, BENCH_ARGS) alternately on this
# tree and the branch's, REPEATS times each, with the kernel tables of every run. Results in
# $OUT: tests.log, check_spin_tokens.json, main-N/ and branch-N/ (decode-step's profile),
# summary.txt (each run's step as served and graph time).
# Env: PATCH (.carry/branch/patch), TESTS (pytest paths, relative to the repo), REPEATS (2),
# BENCH_ARGS (default: two-level Quest, 2 x 128K in 40 GiB, the H100's shape), E2E_RUNS
# (gpu_equal_memory.sh's runs, on this tree after the rest, e.g. one-128k; E2E_ARGS passes),
# SIZING (1: spin-cluster bench check-sizing on this tree, the bundled spin config on
# Qwen2.5-Coder-1.5B's shape at 16K with no KV size, before the e2e runs: check_sizing.{json,log}),
# BRANCH2_ARGS (flags only the branch knows: each repeat also runs side branch2, the branch's
# tree with BENCH_ARGS plus these), AFTER (a command run last in the branch's tree, its package
# laid out, e.g. the branch's own bench; OUT is this job's).
set -o pipefail
source benchmarks/gpu_setup.sh
MAIN=$REPO
BR=/tmp/branch-tree
rm -rf "$BR" && cp -r "$MAIN" "$BR"
PATCH_FILE=$MAIN/${PATCH:-.carry/branch/patch}
if command -v patch >/dev/null; then (cd "$BR" && patch -p1 -s < "$PATCH_FILE"); else (cd "$BR" && git apply "$PATCH_FILE"); fi \
  || { echo "the patch does not apply"; exit 2; }
gpu_record "$OUT/gpu.txt"
echo "commit ${SPIN_COMMIT:-unknown} + branch ${BRANCH_COMMIT:-unknown}" | tee "$OUT/summary.txt"
in_tree() {  # TREE PKG CMD...: CMD with TREE's package laid out in PKG
  local tree=$1 pkg=$2; shift 2
  (cd "$tree" && SPIN_PKG=$pkg source benchmarks/gpu_setup.sh >/dev/null && "$@")
}
if [ -n "${TESTS}" ]; then
  in_tree "$BR" /tmp/pkg-branch bash -c "cd /tmp && timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    $(for t in ${TESTS}; do printf '%s ' "$BR/$t"; done) 2>&1 | tail -20" | tee "$OUT/tests.log"
  in_tree "$BR" /tmp/pkg-branch timeout 240 python3 -P -m spin_cluster.bench check-spin-tokens "${TOK[@]}" \
    --out "$OUT/check_spin_tokens.json" 2>&1 | tail -8 | tee -a "$OUT/tests.log"
fi
args=(${BENCH_ARGS:---mode spin --coarse-pages 16 --context 131072 --batch 2 --gpu-kv-gib 40 --host-kv-gib 72 --steps 20})
sides="main branch"; [ -n "${BRANCH2_ARGS}" ] && sides="main branch branch2"
for i in $(seq "${REPEATS:-2}"); do
  for side in $sides; do
    tree=$MAIN pkg=$PKG extra=(); [ $side != main ] && tree=$BR pkg=/tmp/pkg-branch
    [ $side = branch2 ] && extra=(${BRANCH2_ARGS})
    mkdir -p "$OUT/$side-$i"
    in_tree "$tree" "$pkg" timeout "${MODE_TIMEOUT:-240}" python3 -P -m spin_cluster.bench decode-step "${args[@]}" \
      "${extra[@]}" "${TOK[@]}" --out "$OUT/$side-$i" > "$OUT/$side-$i/profile.log" 2>&1
    echo "$(date +%T) $side $i: $(grep -aoE 'step [0-9.]+ ms as served' "$OUT/$side-$i/profile.log") |" \
      "$(grep -aoE 'graph run on the GPU: [0-9.]+ ms' "$OUT/$side-$i/profile.log")" | tee -a "$OUT/summary.txt"
  done
done
if [ "${SIZING:-0}" = 1 ]; then
  timeout 240 python3 -P -m spin_cluster.bench check-sizing "${TOK[@]}" \
    --out "$OUT/check_sizing.json" 2>&1 | tail -5 | tee "$OUT/check_sizing.log"
fi
[ -n "${E2E_RUNS}" ] && SELECT=0 RUNS="${E2E_RUNS}" bash benchmarks/gpu_equal_memory.sh
[ -n "${AFTER}" ] && in_tree "$BR" /tmp/pkg-branch bash -c "${AFTER}" 2>&1 | tail -60 | tee "$OUT/after.log"
exit 0
