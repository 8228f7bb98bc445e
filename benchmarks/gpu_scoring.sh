#!/usr/bin/env bash
# How Select scores pages, at 4K and 8K on SmolLM2 (device tool, one call, about 5 minutes on
# one H200; the default model's GGUF carried in parts, see gpu_setup.sh). At 1/16 of the
# context, pages of 16: dense, Quest's per-page bounds, Quest's bounds per token (the page's
# best key), sparq with 16 of 64 channels, and labels (the label cache, 16 fixed channels). The 2K CPU study is in docs/accuracy.md
# ("Scoring keys one by one"). Results in $OUT: scoring-<method>-<len>.{json,log}.
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_info
SAMPLES=${SAMPLES:-3}
run() {  # name, length, eval arguments...
  local name=$1 len=$2; shift 2
  (cd /tmp && timeout "${EVAL_TIMEOUT:-150}" python3 -P -m spin_cluster.cli eval --lengths "$len" --samples "$SAMPLES" \
      --budgets 0.0625 --sink-tokens 16 --local-tokens 64 --max-tokens 40 --max-batch 32 --quiet \
      --out "$OUT/scoring-$name-$len.json" "$@" 2>&1 | tail -20) | tee "$OUT/scoring-$name-$len.log"
}
for LEN in 4096 8192; do
  run quest "$LEN" --algorithms dense quest
  run quest-per-token "$LEN" --algorithms quest --option score_block_tokens=1
  run sparq16 "$LEN" --algorithms sparq --option channels=16
  run labels "$LEN" --algorithms labels
done
