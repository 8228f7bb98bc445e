#!/usr/bin/env bash
# Spin against dense with one GPU memory budget for both (device tool, one call, ~8 minutes
# on one H200): dense gets GPU_KV_GIB as KV pages, Spin as its elastic buffer. Runs, each a
# benchmarks/e2e.py invocation with dense and Spin in the same process one after the other:
#   32k      16 x 32K prompts, 100 GiB (all KV fits both)
#   cap24    4 x 128K prompts, 24 GiB (dense holds one request; Spin's shares shrink)
#   labels   4 x 128K prompts, 100 GiB, Spin with the labels Select (its index is r/D of K)
# plus the Select kernel alone (bench_select.py). Results in $OUT: e2e-<run>.json,
# bench_select.json, equal_memory.log. Env: RUNS (subset, default "32k cap24 labels").
set -o pipefail
source benchmarks/gpu_setup.sh
LOG="$OUT/equal_memory.log"
gpu_record "$LOG"
timeout 60 python3 benchmarks/bench_select.py --out "$OUT" 2>&1 | tee -a "$LOG"
run() {  # name, deadline s, e2e.py flags
  local name=$1 deadline=$2; shift 2
  mkdir -p "/tmp/e2e-$name"
  timeout $(( deadline + 90 )) python3 benchmarks/e2e.py --host-kv-gib 72 --deadline-s "$deadline" "${TOK[@]}" \
    --out "/tmp/e2e-$name" "$@" 2>&1 | grep -v "^\[" | tee -a "$LOG"
  cp "/tmp/e2e-$name/e2e.json" "$OUT/e2e-$name.json"
}
for r in ${RUNS:-32k cap24 labels}; do
  case $r in
    32k) run 32k 170 --modes dense spin --workloads offline-32K --offline-lengths 32768 --offline-batch 16 --gpu-kv-gib 100 ;;
    cap24) run cap24 200 --modes dense spin --workloads offline-128K --offline-lengths 131072 --gpu-kv-gib 24 ;;
    labels) run labels 110 --modes spin --algorithm labels --max-num-seqs 4 --workloads offline-128K \
              --offline-lengths 131072 --gpu-kv-gib 100 ;;
  esac
done
