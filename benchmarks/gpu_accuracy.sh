#!/usr/bin/env bash
# SmolLM2 accuracy on the GPU (device tool, one call, under 10 minutes on one H200). Results
# land in $OUT:
#   accuracy-4096.{json,log}, accuracy-8192.{json,log}   spin-cluster eval: every algorithm at
#       1/8, 1/16, 1/32 of the context and dense, attention fidelity, and each offloaded
#       engine's GPU-buffer hit ratio (the real-pattern run of the end-to-end figures)
#   sparse_prefill_accuracy.{json,log}                   block-sparse prefill: uniform vs
#       threshold vs S-HPLB budgets at a quarter of the blocks, dense decode
# The seer gate comes from .carry/gate/seer_gate.safetensors when carried, else it is trained
# here first (about a minute).
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_info
SAMPLES=${SAMPLES:-3}
GATE=/tmp/seer_gate.safetensors
[ -f .carry/gate/seer_gate.safetensors ] && cp .carry/gate/seer_gate.safetensors "$GATE"
if [ ! -f "$GATE" ]; then
  (cd /tmp && timeout 200 python3 -m spin_cluster.cli profile train-gate --out "$GATE" --seq-len 2048 \
      --num-seqs 24 --steps 300 2>&1 | grep -v "it/s\]" | tail -3) | tee "$OUT/seer_gate.log"
fi
for LEN in 4096 8192; do
  (cd /tmp && SPIN_SEER_GATE=$GATE timeout "${EVAL_TIMEOUT:-230}" python3 -m spin_cluster.cli eval --lengths "$LEN" \
      --samples "$SAMPLES" --algorithms dense streaming quest shadowkv retroinfer seer oracle \
      --budgets 0.125 0.0625 0.03125 --sink-tokens 16 --local-tokens 64 --max-tokens 40 \
      --max-batch 32 --fidelity --quiet --out "$OUT/accuracy-$LEN.json" 2>&1 | tail -60) \
      | tee "$OUT/accuracy-$LEN.log"
done
(cd "$REPO" && timeout "${PREFILL_TIMEOUT:-120}" python3 benchmarks/bench_sparse_prefill.py accuracy --lengths 4096 8192 --budget 0.25 \
    --samples "$SAMPLES" --max-batch 32 --out "$OUT/sparse_prefill_accuracy.json" 2>&1 | grep -v "it/s" | tail -40) \
    | tee "$OUT/sparse_prefill_accuracy.log"
