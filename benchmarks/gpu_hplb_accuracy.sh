#!/usr/bin/env bash
# S-HPLB's offline half on the H200 (device tool, one call, ~6 minutes): profile SmolLM2's
# (layer, KV head) sparsity at 2K, 4K and 8K, then RULER-style accuracy of dense and quest at
# 1/8, 1/16 and 1/32 of the context in three budget modes at equal totals: uniform top-k,
# online top-p, and max-min per-head budgets from the profile. The profile ranks pages as the
# serving Select does (HPLB_SELECT, default quest: `profile --select`) at the task prompts'
# answer steps (`--answer-steps`); max-min from a profile ranked by the oracle at the prompts'
# last 16 positions (the objective before) runs beside it. Results in $OUT:
#
#   profile.json  the head profile            profile.md   per-head needs, stability
#   profile-oracle.{json,md}  the same profile ranked by the oracle
#   accuracy-oracle-profile.{md,json}  max-min from the oracle-ranked profile
#   heatmap.png   per-(layer, head) heatmap   accuracy.md  accuracy tables (markdown)
#   accuracy.json every output and score      accuracy.png accuracy vs budget per mode
#   accuracy-floor*.{md,json}  max-min again with larger per-head floors (HPLB_FLOORS)
#   *.log         progress and timings
#
#   bash benchmarks/gpu_hplb_accuracy.sh
#
# The same sequence at toy size on CPU checks the commands (not the figures):
#
#   OUT=/tmp/hplb HPLB_SETUP=0 HPLB_DEVICE=cpu HPLB_LENGTHS=512 HPLB_SAMPLES=1 \
#     HPLB_PROFILE_SAMPLES=1 HPLB_TASKS=niah_single bash benchmarks/gpu_hplb_accuracy.sh
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
LENGTHS=${HPLB_LENGTHS:-"2048 4096 8192"}
SELECT=${HPLB_SELECT:-quest}
SAMPLES=${HPLB_SAMPLES:-4}  # per task and length in the accuracy run
PROFILE_SAMPLES=${HPLB_PROFILE_SAMPLES:-2}  # per task and length in the profile (seeds 1000+)
TASKS=${HPLB_TASKS:-}  # empty: every task
BUDGETS=${HPLB_BUDGETS:-"0.125 0.0625 0.03125"}
TOP_P=${HPLB_TOP_P:-0.9}
FLOORS=${HPLB_FLOORS:-}  # extra max-min floors (fractions of the uniform budget, e.g. "0.5"); main run: 0.25
BATCH=${HPLB_BATCH:-28}
DEVICE=${HPLB_DEVICE:-auto}
DTYPE=${HPLB_DTYPE:-auto}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ "${HPLB_SETUP:-1}" = 1 ]; then
  source benchmarks/gpu_setup.sh
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  PY=python3
else
  PY=${PY:-$(pwd)/.venv/bin/python}
fi
cd /tmp  # import the installed package, not the repository's unmapped top-level folders
"$PY" -c "from spin_cluster.model_store import prepare_default_model as p; print(p())" | tail -1

start=$(date +%s)
# shellcheck disable=SC2086  # word splitting of the lists is intended
"$PY" -m spin_cluster.profiling.cli profile --lengths $LENGTHS --samples "$PROFILE_SAMPLES" --select "$SELECT" --answer-steps \
  --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/profile.json" --plot "$OUT/heatmap.png" \
  > "$OUT/profile.md" 2> "$OUT/profile.log"
cat "$OUT/profile.md"
# shellcheck disable=SC2086
"$PY" -m spin_cluster.profiling.cli profile --lengths $LENGTHS --samples "$PROFILE_SAMPLES" \
  --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/profile-oracle.json" > "$OUT/profile-oracle.md" 2>> "$OUT/profile.log"
echo "profile: $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.log"

# shellcheck disable=SC2086
"$PY" -m spin_cluster.profiling.cli eval --lengths $LENGTHS --samples "$SAMPLES" ${TASKS:+--tasks $TASKS} \
  --algorithms dense quest --budgets $BUDGETS --budget-modes uniform top_p maxmin --top-p "$TOP_P" \
  --profile "$OUT/profile.json" --max-batch "$BATCH" --device "$DEVICE" --dtype "$DTYPE" \
  --out "$OUT/accuracy.json" --plot "$OUT/accuracy.png" > "$OUT/accuracy.md" 2> "$OUT/accuracy.log"
cat "$OUT/accuracy.md"
echo "profile + accuracy: $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.log"

# shellcheck disable=SC2086
"$PY" -m spin_cluster.profiling.cli eval --lengths $LENGTHS --samples "$SAMPLES" ${TASKS:+--tasks $TASKS} \
  --algorithms quest --budgets $BUDGETS --budget-modes maxmin --profile "$OUT/profile-oracle.json" \
  --max-batch "$BATCH" --device "$DEVICE" --dtype "$DTYPE" \
  --out "$OUT/accuracy-oracle-profile.json" > "$OUT/accuracy-oracle-profile.md" 2> "$OUT/accuracy-oracle-profile.log"
cat "$OUT/accuracy-oracle-profile.md"

for floor in $FLOORS; do
  # shellcheck disable=SC2086
  "$PY" -m spin_cluster.profiling.cli eval --lengths $LENGTHS --samples "$SAMPLES" ${TASKS:+--tasks $TASKS} \
    --algorithms quest --budgets $BUDGETS --budget-modes maxmin --floor-fraction "$floor" \
    --profile "$OUT/profile.json" --max-batch "$BATCH" --device "$DEVICE" --dtype "$DTYPE" \
    --out "$OUT/accuracy-floor$floor.json" > "$OUT/accuracy-floor$floor.md" 2> "$OUT/accuracy-floor$floor.log"
  cat "$OUT/accuracy-floor$floor.md"
done
echo "all: $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.log"
