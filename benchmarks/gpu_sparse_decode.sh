#!/usr/bin/env bash
# The sparse algorithms' GPU runs (device tool). Results land in $OUT.
#   bash benchmarks/gpu_sparse_decode.sh speed          GPU tests of the Select/decode kernels and the
#                                                Spin path, then bench_sparse_decode.py
#   bash benchmarks/gpu_sparse_decode.sh accuracy LEN   train the seer gate (once per warm machine),
#                                                then spin-cluster eval at LEN tokens, every
#                                                algorithm at 1/8, 1/16, 1/32, with fidelity
set -o pipefail
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
case "$1" in
speed)
  (cd /tmp && timeout 240 python3 -m pytest "$REPO/tests/kernels" "$REPO/tests/engine/test_spin_gpu.py" \
      -m gpu -q -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/gpu_tests.log"
  timeout 240 python3 -P -m spin_cluster.bench sparse-decode --out "$OUT/sparse_decode.json" 2>&1 | tee "$OUT/sparse_decode.log"
  ;;
accuracy)
  LEN=${2:-4096}
  (cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
  GATE=/tmp/seer_gate.safetensors
  if [ ! -f "$GATE" ]; then
    (cd /tmp && timeout 200 python3 -P -m spin_cluster.cli profile train-gate --out "$GATE" --seq-len 2048 \
        --num-seqs 24 --steps 300 2>&1 | grep -v "it/s\]" | tail -3) | tee "$OUT/seer_gate.log"
  fi
  cp "$GATE" "$OUT/"
  (cd /tmp && SPIN_SEER_GATE=$GATE timeout ${EVAL_TIMEOUT:-420} python3 -P -m spin_cluster.cli eval --lengths "$LEN" \
      --samples "${SAMPLES:-6}" --algorithms dense streaming quest shadowkv retroinfer seer \
      --budgets 0.125 0.0625 0.03125 --sink-tokens 16 --local-tokens 64 --max-tokens 48 \
      --max-batch 42 --fidelity --out "$OUT/accuracy-$LEN.json" 2>&1 | grep -v "it/s\]" | tail -40) \
      | tee "$OUT/accuracy-$LEN.log"
  ;;
*) echo "usage: gpu_sparse_decode.sh speed | accuracy LEN" >&2; exit 2 ;;
esac
