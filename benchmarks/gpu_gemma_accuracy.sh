#!/usr/bin/env bash
# Gemma-3-270M's accuracy at length on the GPU (device tool). Gemma-3-270M is a 32K base model
# (sliding-window layers and one full-attention layer in six); Spin serves its full-attention
# layers. Its GGUF travels in parts first (`bash benchmarks/carry_gemma.sh` here, then one
# call per part while the machine stays warm, each carrying .carry/gemma/count and
# .carry/gemma/p<N> with the command `source benchmarks/gpu_setup.sh`); this call carries
# .whl (the gguf and pydantic wheels) and prepares the model as `spin-cluster models prepare
# gemma-3-270m` would. Results in $OUT, each run's JSON and log:
#   passkey-<len>   the passkey task, $SAMPLES prompts (default 36), dense beside quest, labels
#                   and labels+quest at 1/16 and 1/32 of the context with the 2048-token floor
#   needles-<len>   the four needle tasks, the same methods, $SAMPLES prompts each
#   spin-<len>      the bundled `spin` config's Select (labels, floor 2048, hysteresis 0.5) at
#                   SPIN_BUDGETS (default 1/16 and 1/32) on SPIN_TASKS (default passkey and the
#                   needle tasks); SPIN_ALGOS (default labels) to set others beside it, and
#                   SPIN_OPTIONS their sparse.options, KEY=VALUE words (e.g. "quest_layers=11")
#   profile.json    the model's per-head profile (quest-ranked, answer steps) at $LENGTHS
#   hplb-<len>      HPLB_ALGOS (default quest) at HPLB_BUDGETS (default 1/16 and 1/32): uniform
#                   against S-HPLB max-min budgets from the profile, on HPLB_TASKS (default passkey
#                   and the needle tasks), with the HPLB_FLOOR-token floor (default 2048; 0: none).
#                   Max-min takes no head under the floor, so at 1/16 up to 32K the budgets are
#                   uniform; HPLB_BUDGETS="0.25 0.125" at 16K shifts above it
# Env: LENGTHS (default "8192 12288 16384"; 32768 shows where dense itself stops), PARTS (default
# "passkey needles spin hplb"), SAMPLES, and each part's timeout (PASSKEY_TIMEOUT, ... in s).
# On the CPU the same commands run at toy size (checks the commands, not the figures):
#   OUT=/tmp/g GEMMA_SETUP=0 LENGTHS=1024 SAMPLES=1 DEVICE=cpu bash benchmarks/gpu_gemma_accuracy.sh
set -o pipefail
source benchmarks/accuracy_setup.sh
accuracy_setup "${GEMMA_SETUP:-1}"
LENGTHS=${LENGTHS:-"8192 12288 16384"}
SAMPLES=${SAMPLES:-36}
PARTS=${PARTS:-"passkey needles spin hplb"}
DEVICE=${DEVICE:-auto}
MODEL=$(prepared_model gemma-3-270m) || exit 1
cd /tmp  # import the installed package, not the repository's unmapped top-level folders
METHODS=(--algorithms quest labels labels+quest --budgets 0.0625 0.03125 --budget-floor 2048)
NEEDLES=(niah_single niah_multikey niah_multivalue niah_multiquery)
SPIN_OPTS=()
for kv in ${SPIN_OPTIONS}; do SPIN_OPTS+=(--option "$kv"); done
has() { [[ " $PARTS " == *" $1 "* ]]; }
run() {  # name, timeout_s, eval arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$PY" -m spin_cluster.cli eval --model "$MODEL" --device "$DEVICE" --sink-tokens 16 \
    --local-tokens 64 --max-batch 64 --quiet --out "$OUT/$name.json" "$@" 2>&1 | tail -40 | tee "$OUT/$name.log"
}
for LEN in $LENGTHS; do
  has passkey && run "passkey-$LEN" "${PASSKEY_TIMEOUT:-300}" --lengths "$LEN" --tasks passkey --samples "$SAMPLES" \
    "${METHODS[@]}" --max-tokens 10
  has needles && run "needles-$LEN" "${NEEDLES_TIMEOUT:-600}" --lengths "$LEN" --tasks "${NEEDLES[@]}" \
    --samples "$SAMPLES" "${METHODS[@]}" --max-tokens 32
  # shellcheck disable=SC2086  # the tasks split into words
  has spin && run "spin-$LEN" "${SPIN_TIMEOUT:-300}" --lengths "$LEN" --tasks ${SPIN_TASKS:-passkey ${NEEDLES[*]}} \
    --samples "$SAMPLES" --algorithms ${SPIN_ALGOS:-labels} --budgets ${SPIN_BUDGETS:-0.0625 0.03125} --budget-floor 2048 --resident-margin 0.5 --max-tokens 32 \
    "${SPIN_OPTS[@]}"
done
if has hplb; then
  # shellcheck disable=SC2086  # the lengths split into words
  timeout "${PROFILE_TIMEOUT:-300}" "$PY" -m spin_cluster.cli profile --model "$MODEL" --lengths $LENGTHS --samples 2 \
    --select quest --answer-steps --device "$DEVICE" --out "$OUT/profile.json" > "$OUT/profile.md" 2> "$OUT/profile.log"
  for LEN in $LENGTHS; do
    # shellcheck disable=SC2086  # the tasks split into words
    run "hplb-$LEN" "${HPLB_TIMEOUT:-600}" --lengths "$LEN" --tasks ${HPLB_TASKS:-passkey ${NEEDLES[*]}} --samples "$SAMPLES" \
      --algorithms ${HPLB_ALGOS:-quest} --budgets ${HPLB_BUDGETS:-0.0625 0.03125} --budget-floor "${HPLB_FLOOR:-2048}" \
      --budget-modes uniform maxmin --profile "$OUT/profile.json" \
      --max-tokens 32
  done
fi
