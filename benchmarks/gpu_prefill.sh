#!/usr/bin/env bash
# Time to first token at 32K and 128K on one GPU (device tool; with ACCURACY=0 one call of about
# 5.5 minutes on an H200, its steps' limits adding up to 510 s; the accuracy step adds up to
# 200 s, so run it in a call of its own when the timings must fit in one). Results
# land in $OUT:
#   prefill_choices.log      the dense prefill backend chosen (cuDNN probe) and whether the
#                            block-sparse kernel may read K/V through tensor descriptors
#   prefill_tests.log        the -m gpu tests first: the dense prefill backend (cuDNN on Hopper,
#                            chunked included) against flash, every autotune tile of the
#                            block-sparse kernel and the kernel at Llama shapes against the
#                            torch reference: a broken kernel shows here before any timing
#   prefill_dense.{json,log} the engine's dense prefill attention, flash and cuDNN, whole prompt
#                            and 2K-token chunks, at 32K and 128K: ms and TFLOP/s
#   prefill_kernel.{json,log} block-sparse prefill against the fastest dense backend (both
#                            reported): selection vs attention, TFLOP/s on visited blocks,
#                            uniform / threshold / S-HPLB, threshold at S-HPLB's accuracy
#   prefill_ttft.{json,log}  TTFT of one 32K and one 128K prompt (Llama-3.1-8B shapes, random
#                            weights, benchmarks/prefill_ttft.py): dense (cuDNN) whole, and
#                            block-sparse, median of 3 with min and max; dense in 2K chunks
#                            and dense on flash, one run each; then a kernel profile of one
#                            128K prompt, dense and sparse
#   prefill_accuracy.{json,log} SmolLM2 at 4K/8K with the strided estimate (the accuracy table's
#                            setting: 64-position blocks, a quarter of the middle blocks)
# Usage (device machine, repo root; carry .carry/tok, or the default model's GGUF parts for
# the accuracy step and as the TTFT model's tokenizer; ACCURACY=0 skips the accuracy step):
#   SPIN_COMMIT=<commit> bash benchmarks/gpu_prefill.sh
# Dry run on a CPU (tiny shapes, Triton's interpreter, PYTHONPATH as for the tests):
#   DRY=1 OUT=/tmp/prefill-dry bash benchmarks/gpu_prefill.sh
set -o pipefail
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
  : "${OUT:?set OUT for a dry run}"
  mkdir -p "$OUT"
  REPO=$(pwd)
  export TRITON_INTERPRET=1
  TESTS=("$REPO/tests/test_dense_attention.py" "$REPO/tests/kernels/test_block_sparse_prefill.py"
         "$REPO/tests/kernels/test_prefill_estimate.py")
  MARK=(); DENSE=(--lengths 1024 --chunk 256 --repeats 1); KERNEL=(--lengths 1024 --block-size 64 --ranks 2)
  TTFT=(--lengths 256 --layers 1 --runs 1 --ref-runs 1 --block-size 64); ACC=(); T_SCALE=4; TOK=()
else
  source benchmarks/gpu_setup.sh
  gpu_record
  TESTS=("$REPO/tests/test_dense_attention.py" "$REPO/tests/kernels/test_block_sparse_prefill.py"
         "$REPO/tests/kernels/test_prefill_estimate.py")
  MARK=(-m gpu); DENSE=(); KERNEL=(--lengths 32768 131072); TTFT=(); ACC=(--budget 0.25 --samples 3 --max-batch 32); T_SCALE=1
  (cd /tmp && $PY -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
fi
step() { echo "== $(date -u +%H:%M:%S) $*"; }

step "kernel choices at Llama-3.1-8B attention shapes"
(cd /tmp && timeout $((40 * T_SCALE)) $PY -) <<'PY' 2>&1 | tee "$OUT/prefill_choices.log"
import torch
from spin_cluster.dense_attention import device_backend
from spin_cluster.kernels.block_sparse_prefill import descriptors_usable
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("dense prefill backend:", device_backend(dev, torch.bfloat16, 32, 8, 128))
q = torch.zeros(256, 32, 128, device=dev, dtype=torch.bfloat16)
k = torch.zeros(8, 256, 128, device=dev, dtype=torch.bfloat16)
print("block-sparse K/V through tensor descriptors:", descriptors_usable(q, k, k))
PY

step "GPU tests (correctness before timings)"
(cd /tmp && timeout $((120 * T_SCALE)) $PY -m pytest "${TESTS[@]}" "${MARK[@]}" -q -p no:cacheprovider -rs 2>&1 \
  | tail -15) | tee "$OUT/prefill_tests.log"
grep -qE "[0-9]+ passed" "$OUT/prefill_tests.log" && ! grep -qE "failed|error" "$OUT/prefill_tests.log" \
  || echo "GPU TESTS FAILED: read prefill_tests.log before the timings below" | tee -a "$OUT/prefill_tests.log"

step "dense prefill attention: flash vs cuDNN, whole and chunked"
timeout $((50 * T_SCALE)) $PY benchmarks/bench_sparse_prefill.py dense "${DENSE[@]}" --out "$OUT/prefill_dense.json" 2>&1 \
  | tee "$OUT/prefill_dense.log"

step "block-sparse prefill kernel against the fastest dense backend"
timeout $((130 * T_SCALE)) $PY benchmarks/bench_sparse_prefill.py kernel "${KERNEL[@]}" --out "$OUT/prefill_kernel.json" 2>&1 \
  | tee "$OUT/prefill_kernel.log"

step "TTFT: dense (both backends) vs block-sparse"
timeout $((240 * T_SCALE)) $PY benchmarks/prefill_ttft.py --profile "${TTFT[@]}" "${TOK[@]}" --out "$OUT/prefill_ttft.json" 2>&1 \
  | tee "$OUT/prefill_ttft.log"

if [ "${DRY:-0}" = 1 ] || [ "${ACCURACY:-1}" = 0 ]; then
  step "accuracy skipped (dry run or ACCURACY=0)"
else
  step "SmolLM2 accuracy of sparse prefill with the strided estimate"
  timeout 200 $PY benchmarks/bench_sparse_prefill.py accuracy "${ACC[@]}" --out "$OUT/prefill_accuracy.json" 2>&1 \
    | grep -v "it/s" | tee "$OUT/prefill_accuracy.log"
fi
step "done"
