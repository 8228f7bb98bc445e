#!/usr/bin/env bash
# A session's Qwen2.5-Coder-Instruct figures on the GPU (device tool), both halves on one model:
# started in the background (benchmarks/gpu_background.sh qwen benchmarks/gpu_qwen_session.sh)
# by the call that carries the model's last chunk (benchmarks/carry_qwen.sh), collected by the
# calls after it. Phases, in order, each into its own folder of $OUT, so that a session cut
# short keeps the phases it finished:
#   prepare     `spin-cluster models prepare` (CPU), then waits for job WAIT_FOR (the kernels'
#               check, default) to free the GPU, at most WAIT_S (default 300)
#   acc-<len>   RULER-style accuracy (gpu_qwen_accuracy.sh): dense and CONFIGS (default: spin,
#               spin-fast, and spin-fast's decode alone, benchmarks/configs/quest-2048.yaml) at
#               each of ACC_LENGTHS (default "32768"), SAMPLES per task (default 8)
#   speed-<c>   benchmarks/e2e.py on the model's real weights and the suite's prompts: PROMPT_LEN
#               tokens in (default 32768), OUTPUT tokens out (default 4096; past the model's 32K
#               every mode runs YaRN, factor 4), BATCH requests arriving at once (default 40),
#               each mode with GPU_KV_GIB of GPU memory (default 16: dense holds 16 of them at a
#               time); dense and spin with the bundled config <c>, for each of SPEED_CONFIGS
#               (default "spin spin-fast"; dense runs with the first only)
#   acc-<len>   then ACC_LATER lengths (default "16384")
# Env: MODEL_NAME (default qwen2.5-coder-1.5b), PHASES (default "acc speed later"), HOST_KV_GIB
# (default 64), SPEED_DEADLINE_S (per mode, default 300), SPEED_ARGS (more e2e.py flags).
set -o pipefail
source benchmarks/accuracy_setup.sh
source benchmarks/gpu_background.sh  # wait_job
accuracy_setup "${QWEN_SETUP:-1}"
MODEL_NAME=${MODEL_NAME:-qwen2.5-coder-1.5b}
t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/session.txt"; }
MODEL=$(prepared_model "$MODEL_NAME") || exit 1
say "prepared $MODEL"
wait_job "${WAIT_FOR:-kernels}" "${WAIT_S:-300}" | tee -a "$OUT/session.txt"
accuracy() {  # lengths...
  for len in "$@"; do
    env OUT="$OUT/acc-$len" QWEN_SETUP="${QWEN_SETUP:-1}" LENGTHS="$len" SAMPLES="${SAMPLES:-8}" MODEL_NAME="$MODEL_NAME" \
      CONFIGS="${CONFIGS:-spin spin-fast benchmarks/configs/quest-2048.yaml}" \
      "TIMEOUT_$len=${ACC_TIMEOUT:-900}" bash benchmarks/gpu_qwen_accuracy.sh
    say "accuracy at $len done"
  done
}
speed() {
  local first=1 conf modes n extra=()
  local len=${PROMPT_LEN:-32768} out=${OUTPUT:-4096}
  [ $(( len + out )) -gt 32768 ] && extra=(--hf-overrides "$YARN")
  for conf in ${SPEED_CONFIGS:-spin spin-fast}; do
    modes="spin"; [ $first = 1 ] && modes="dense spin"; first=0
    n=$(wc -w <<< "$modes")
    mkdir -p "$OUT/speed-$conf"
    # shellcheck disable=SC2086  # the modes split into words
    # -P: the laid-out package, not the repository's unmapped folders; bench finds benchmarks/ here.
    (timeout $(( n * ${SPEED_DEADLINE_S:-300} + 180 )) "$PY" -P -m spin_cluster.bench e2e --model "$MODEL" \
      --prompts ruler --config "$conf" --modes $modes --workloads "offline-$(( len / 1024 ))K" --offline-lengths "$len" \
      --offline-batch "${BATCH:-40}" --max-num-seqs "${BATCH:-40}" --output-tokens "$out" \
      --gpu-kv-gib "${GPU_KV_GIB:-16}" --host-kv-gib "${HOST_KV_GIB:-64}" --deadline-s $(( n * ${SPEED_DEADLINE_S:-300} )) \
      ${SPEED_ARGS} "${extra[@]}" --out "$OUT/speed-$conf" 2>&1) | tee "$OUT/speed-$conf/e2e.log" | tail -30
    say "speed with $conf done"
  done
}
for phase in ${PHASES:-acc speed later}; do
  case $phase in
    acc) accuracy ${ACC_LENGTHS:-32768} ;;
    speed) speed ;;
    later) accuracy ${ACC_LATER:-16384} ;;
  esac
done
say "session done"
