#!/usr/bin/env bash
# Spin against dense with one GPU memory budget for both (device tool, one call per group of
# runs that fits in 10 minutes on one H200): dense gets GPU_KV_GIB as KV pages, Spin as its
# elastic buffer. Runs, each a benchmarks/e2e.py invocation with its modes in one process, one
# after the other (minutes on an H200 in brackets):
#   128k     4 x 128K prompts, 100 GiB (all KV fits both): the headline, with dense's batch-1 roofline [4]
#   32k      16 x 32K prompts, 100 GiB (all KV fits both) [3]
#   cap24    4 x 128K prompts, 24 GiB (dense holds one request; Spin's shares shrink) [3.5]
#   labels   4 x 128K prompts, 100 GiB, Spin with the bundled config's Select: labels in e4m3
#            with Select's hysteresis (resident_margin 0.5) [2]
#   online   4 x 32K prompts arriving at 2, 1 and 0.5 requests/s, 100 GiB, dense and Spin [2.5]
#   prefill  4 x 128K and the online arrivals, 100 GiB, Spin with block-sparse prefill (1/8 of
#            the blocks, per-head fractions): the whole request, TTFT included [6]
#   one-128k one 128K request alone, 40 GiB (dense holds it): Spin's step against dense's [3]
#   h100-32k, h100-128k, labels-h100-32k, labels-h100-128k
#            the H100's shapes (its 80 GB hold neither the 100 GiB nor dense's 4 x 128K): 8 x 32K
#            and 2 x 128K prompts in 40 GiB each, dense and Spin, then Spin with labels as above
# plus the Select kernel alone (bench_select.py). Results in $OUT: e2e-<run>.{json,md},
# bench_select.json, equal_memory.log. Env: RUNS (default "32k cap24 labels"; e.g. RUNS="128k
# 32k" in one call, RUNS="cap24 labels online" in the next); E2E_ARGS: more e2e.py flags for
# every run, e.g. "--coarse-pages 16" (Quest's two-level Select; the labels run ignores it);
# LABELS_ARGS: the labels run's own (default the bundled config's e4m3 labels, "--sparse-option
# index_dtype=float8_e4m3fn"; "--sparse-option index_dtype=bfloat16" gives the runs before
# 2026-12-06's; add e.g. "--sparse-option channels=0.5").
set -o pipefail
source benchmarks/gpu_setup.sh
LOG="$OUT/equal_memory.log"
gpu_record "$LOG"
[ "${SELECT:-1}" = 1 ] && timeout 60 python3 -P -m spin_cluster.bench select --out "$OUT" 2>&1 | tee -a "$LOG"
run() {  # name, deadline s, e2e.py flags
  local name=$1 deadline=$2; shift 2
  local extra=(${E2E_ARGS})
  [ "${name#labels}" != "$name" ] && extra=(${LABELS_ARGS---sparse-option index_dtype=float8_e4m3fn})  # not Quest's options
  mkdir -p "/tmp/e2e-$name"
  timeout $(( deadline + 90 )) python3 -P -m spin_cluster.bench e2e --host-kv-gib 72 --deadline-s "$deadline" "${TOK[@]}" \
    --out "/tmp/e2e-$name" "$@" "${extra[@]}" 2>&1 | tee "/tmp/e2e-$name/raw.log" | grep -v "^\[" | tee -a "$LOG"
  grep -a "warmed" "/tmp/e2e-$name/raw.log" | tee -a "$LOG"  # the start-up warm-up's cost
  cp "/tmp/e2e-$name/e2e.json" "$OUT/e2e-$name.json"
  cp "/tmp/e2e-$name/e2e.md" "$OUT/e2e-$name.md" 2>/dev/null
}
ONLINE=(online-2rps online-1rps online-0.5rps)
for r in ${RUNS:-32k cap24 labels}; do
  case $r in
    128k) run 128k 230 --modes dense spin --workloads offline-128K --offline-lengths 131072 --offline-batch 4 \
            --gpu-kv-gib 100 ;;
    online) run online 130 --modes dense spin --workloads "${ONLINE[@]}" --offline-lengths 32768 --gpu-kv-gib 100 ;;
    prefill) run prefill 300 --modes spin --sparse-prefill 0.125 --workloads offline-128K "${ONLINE[@]}" \
               --offline-lengths 131072 --offline-batch 4 --gpu-kv-gib 100 ;;
    32k) run 32k 170 --modes dense spin --workloads offline-32K --offline-lengths 32768 --offline-batch 16 --gpu-kv-gib 100 ;;
    cap24) run cap24 200 --modes dense spin --workloads offline-128K --offline-lengths 131072 --gpu-kv-gib 24 ;;
    one-128k) run one-128k 150 --modes dense spin --workloads offline-128K --offline-lengths 131072 --offline-batch 1 \
                --gpu-kv-gib 40 ;;
    labels) run labels 110 --modes spin --algorithm labels --resident-margin 0.5 --max-num-seqs 4 --workloads offline-128K \
              --offline-lengths 131072 --gpu-kv-gib 100 ;;
    h100-32k|labels-h100-32k)
      modes=(--modes dense spin); [ "$r" = labels-h100-32k ] && modes=(--modes spin --algorithm labels --resident-margin 0.5)
      run "$r" 170 "${modes[@]}" --workloads offline-32K --offline-lengths 32768 --offline-batch 8 --gpu-kv-gib 40 ;;
    h100-128k|labels-h100-128k)
      modes=(--modes dense spin); [ "$r" = labels-h100-128k ] && modes=(--modes spin --algorithm labels --resident-margin 0.5)
      run "$r" 200 "${modes[@]}" --workloads offline-128K --offline-lengths 131072 --offline-batch 2 --gpu-kv-gib 40 ;;
  esac
done
