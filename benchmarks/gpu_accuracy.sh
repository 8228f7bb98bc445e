#!/usr/bin/env bash
# SmolLM2 accuracy on the GPU (device tool; the default model's GGUF carried in parts, see
# gpu_setup.sh). One call per length (LENGTHS=2048, then 4096, then 8192): a length's three runs
# may take up to 410 s (their time limits); with 40/20/60 s limits every run of a three-length
# call was killed before it wrote a result on an H200 (2026-12-01). The tables of
# docs/accuracy.md ("Every algorithm at 2K, 4K and 8K"): at each length, every Select at 1/8, 1/16 and 1/32 of the
# context with dense beside it, on
#   passkey-<len>.{json,log}   the passkey task, $PASSKEY_SAMPLES prompts (default 12)
#   ruler-<len>.{json,log}     the seven RULER-style tasks, $SAMPLES prompts each (default 2)
#   spin-<len>.{json,log}      the bundled `spin` config's Select (labels, 1/16, hysteresis
#                              0.5 nats) on passkey and the needle tasks
#   spin-<len>-m<M>.{json,log} the same Select with hysteresis M nats, for each M of
#                              $MARGINS other than 0.5 (default "0.5": the bundled margin only)
#   spin-<len>-<TAG>...        with SPIN_TAG=<TAG> SPIN_EXTRA="<eval arguments>": a variant of
#                              those rows, e.g. SPIN_TAG=c32 SPIN_EXTRA="--option channels=32"
# Lengths: $LENGTHS (required; one per call). $PARTS picks the runs (default "passkey spin
# ruler"), so that an 8K length can split over two calls: PARTS="passkey spin", then ruler. seer runs only when its gate is carried
# (.carry/gate/seer_gate.safetensors; training it here would take a minute of the budget).
# Each run has its own timeout, passkey first, so that a slow machine loses the last tables,
# not the first. Sparse prefill's accuracy is benchmarks/gpu_prefill.sh.
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_info
LENGTHS=${LENGTHS:?set LENGTHS to one of 2048 4096 8192 (one length per device call)}
SAMPLES=${SAMPLES:-2}
PASSKEY_SAMPLES=${PASSKEY_SAMPLES:-12}
PARTS=${PARTS:-"passkey spin ruler"}
MARGINS=${MARGINS:-0.5}
GATE=/tmp/seer_gate.safetensors
ALGOS="streaming quest shadowkv retroinfer labels oracle"
if [ -f .carry/gate/seer_gate.safetensors ]; then
  cp .carry/gate/seer_gate.safetensors "$GATE"
  ALGOS="$ALGOS seer"
fi
run() {  # name, timeout_s, eval arguments...
  local name=$1 limit=$2; shift 2
  (cd /tmp && SPIN_SEER_GATE=$GATE timeout "$limit" python3 -P -m spin_cluster.cli eval --sink-tokens 16 \
      --local-tokens 64 --max-batch 64 --quiet --out "$OUT/$name.json" "$@" 2>&1 | tail -40) | tee "$OUT/$name.log"
}
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has passkey; then
  for LEN in $LENGTHS; do
    # shellcheck disable=SC2086
    run "passkey-$LEN" "${PASSKEY_TIMEOUT:-150}" --lengths "$LEN" --tasks passkey --samples "$PASSKEY_SAMPLES" \
        --algorithms $ALGOS --budgets 0.125 0.0625 0.03125 --max-tokens 10
  done
fi
if has spin; then
  for LEN in $LENGTHS; do
    for M in $MARGINS; do
      name="spin-$LEN${SPIN_TAG:+-$SPIN_TAG}"; [ "$M" = 0.5 ] || name="$name-m$M"
      # shellcheck disable=SC2086
      run "$name" "${SPIN_TIMEOUT:-60}" --lengths "$LEN" --tasks passkey niah_single niah_multikey \
          --samples "$PASSKEY_SAMPLES" --algorithms labels --budgets 0.0625 --resident-margin "$M" --max-tokens 16 \
          ${SPIN_EXTRA:-}
    done
  done
fi
if has ruler; then
  for LEN in $LENGTHS; do
    # shellcheck disable=SC2086
    run "ruler-$LEN" "${RULER_TIMEOUT:-200}" --lengths "$LEN" --samples "$SAMPLES" \
        --tasks niah_single niah_multikey niah_multivalue niah_multiquery vt cwe fwe \
        --algorithms $ALGOS --budgets 0.125 0.0625 0.03125 --max-tokens 32
  done
fi
