#!/usr/bin/env bash
# One capacity over the GPU and the host (device tool, repo root, .carry/tok carried): Spin's
# pages live on the GPU while there is room and spill to the host coldest first, so Spin
# holds what HBM and pinned host memory hold together, where dense holds what HBM holds.
# Runs, each within one 10-minute call on one H200:
#   check   GPU tests of the cache and the Spin path, and check_spin_tokens (Spin's path,
#           spills included, gives dense's tokens with CUDA graphs on) [2]
#   cap64   64 x 32K prompts, 1024 output tokens each (256 GiB of KV: more than either tier
#           holds), the whole GPU (108 GiB of KV pages for dense; 108 GiB of home pages and
#           buffer plus 88 GiB of host for Spin), --max-num-seqs 64, dense and Spin [7.5]
#           (Spin with per-head buffer shares and block-sparse prefill, PREFILL=0.125 of the blocks)
#   cap64f  cap64 with FP8 host pages (cache.host_kv_dtype fp8: half the host and PCIe bytes), and
#           Select's hysteresis MARGIN nats (default 0) toward pages already on the GPU [9.5]
#   cap64s  the same, Spin alone and 256 output tokens (a quick look at its peak batch) [4]
#   fp8     the FP8 host page kernels against their reference, from pinned host memory [1]
#   128k    4 x 128K prompts, 100 GiB each mode, dense prefill in both: TTFT and whole-batch
#           throughput of Spin (pages born on the GPU; per-head buffer shares, so that the
#           buffer reserves each head its own selection and the rest of the 100 GiB are home
#           pages) beside dense [4.5]
#   128ks   128k with Spin's prefill block-sparse (PREFILL of the blocks, default 0.125), dense's
#           cuDNN as before: each mode's best prefill, the whole batch [4.5]
#   q32     Qwen2.5-32B shapes (64 GB of weights): N32 (default 4) x 128K prompts, 256 output tokens,
#           60 GiB of GPU KV for each mode (dense holds one or two), Spin with 88 GiB of FP8 host
#           pages behind its 60 GiB, block-sparse prefill PREFILL and hysteresis MARGIN (cap64f's) [9.5]
#   g27     Gemma-3-27B shapes (54 GB of weights, one layer in six full attention): 4 x 128K prompts, 256
#           output tokens, 60 GiB of GPU KV for each mode (dense holds the four: ~10.4 GiB each), Spin
#           serving the full-attention layers with per-head shares and block-sparse prefill PREFILL.
#           At batch 4 the weights bound the step: its byte floor is ~1.75x dense's at best [7]
#   mixed   what one more 32K prompt costs a loaded server: dense decoding 25 x 32K (its GPU holds 26),
#           Spin 59 x 32K (GPU full, FP8 host pages, spills; cap64f peaked at 60), each then prefills a
#           32K prompt beside its batch, timed and profiled (bench decode-step --mixed) [5];
#           CTX=131072 MIXED="dense:3 spin:3" GPU_KV=100 MAXSEQS=4 for the 4 x 128K case (MAXSEQS, default
#           64: Quest's index is sized max_num_seqs x max_model_len, 34 GiB at 64 x 128K)
#   m1      one request of 1M tokens (128 GiB of bf16 KV: more than the free HBM or the pinnable host
#           memory), Spin alone: 90 GiB of GPU KV, FP8 host pages, block-sparse prefill in chunks of
#           M1_CHUNK tokens (default 131072: each later chunk gathers its context, so few and large),
#           256 output tokens [<= 10]
#   pprof   where a 128K prompt's prefill goes in the stream's 32K chunks (benchmarks/prefill_ttft.py
#           --spin-chunk 32768 --sparse-chunks --profile): dense and block-sparse prefill, each on the
#           paged cache beside Spin's cache (pages born on the GPU, context read from its homes) [6]
#   sweep   the request stream (spin-cluster bench serve) at one rate per call (RATE, default
#           inf; PROMPTS, default 128): log-uniform 8K-128K prompts, 256-2048 output tokens,
#           dense and Spin (FP8 host pages, hysteresis MARGIN, default 0.5, block-sparse prefill
#           PREFILL, default 0.125: the settings of cap64f). 128 such requests take a mode 5-8
#           minutes, so one mode per call: MODES (default "dense spin"), each within DEADLINE s
#           (default 470 for one mode, 230 for two: each engine first warms up at every power-of-two
#           prompt class, ~30 s a mode at 8B shapes; SWEEP_TIMEOUT s, default 590, bounds the
#           run) [10]; `spin-cluster bench serve --merge serve-inf-dense.json serve-inf-spin.json
#           --out F` makes one report of calls made apart
# Results in $OUT: capacity.log, e2e-<run>.{json,md}, check_spin_tokens.json, serve-<rate>.*.
set -o pipefail
source benchmarks/gpu_setup.sh
LOG="$OUT/capacity.log"
gpu_record "$LOG"
echo "commit ${SPIN_COMMIT:-unknown}" | tee -a "$LOG"
run() {  # name, deadline s, e2e.py flags
  local name=$1 deadline=$2; shift 2
  mkdir -p "/tmp/e2e-$name"
  timeout $(( deadline + 60 )) python3 -P -m spin_cluster.bench e2e --host-kv-gib 88 --gpu-kv-gib 108 \
    --deadline-s "$deadline" "${TOK[@]}" --out "/tmp/e2e-$name" "$@" 2>&1 | grep -v "^\[" | tee -a "$LOG"
  cp "/tmp/e2e-$name/e2e.json" "$OUT/e2e-$name.json"
  cp "/tmp/e2e-$name/e2e.md" "$OUT/e2e-$name.md" 2>/dev/null
}
CAP=(--workloads offline-32K --offline-lengths 32768 --offline-batch 64 --max-num-seqs 64 --max-batched-tokens 32768)
for r in ${RUNS:-check}; do
  case $r in
    check)
      (cd /tmp && timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$REPO/tests/profiling/test_lru.py" "$REPO/tests/kvcache/test_buffer.py" \
        "$REPO/tests/engine/test_spin_gpu.py" "$REPO/tests/engine/test_spin_graphs.py" 2>&1 | tail -15) | tee -a "$LOG"
      timeout 240 python3 -P -m spin_cluster.bench check-spin-tokens "${TOK[@]}" --out "$OUT/check_spin_tokens.json" \
        2>&1 | tail -8 | tee -a "$LOG" ;;
    cap64) run cap64 480 --modes dense spin "${CAP[@]}" --output-tokens 1024 --per-head-shares --sparse-prefill "${PREFILL:-0.125}" ;;
    cap64f) run cap64f 520 --modes dense spin "${CAP[@]}" --output-tokens 1024 --per-head-shares \
              --sparse-prefill "${PREFILL:-0.125}" --host-kv-dtype fp8 --resident-margin "${MARGIN:-0}" ;;
    cap64s) run cap64s 240 --modes spin "${CAP[@]}" --output-tokens 256 ;;
    fp8)
      (cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$REPO/tests/kernels/test_fp8_pages.py" \
        2>&1 | tail -6) | tee -a "$LOG" ;;
    sweep)
      mkdir -p /tmp/serve
      modes=(${MODES:-dense spin}); tag="${RATE:-inf}${MODES:+-${MODES// /-}}"
      timeout "${SWEEP_TIMEOUT:-590}" python3 -P -m spin_cluster.bench serve --modes "${modes[@]}" --request-rate "${RATE:-inf}" \
        --num-prompts "${PROMPTS:-128}" --input-len-dist log-uniform:8192:131072 --output-len-dist uniform:256:2048 \
        --goodput ttft:60000 tpot:150 --gpu-kv-gib 108 --host-kv-gib 88 --max-num-seqs 64 --max-batched-tokens 32768 \
        --per-head-shares --sparse-prefill "${PREFILL:-0.125}" --host-kv-dtype fp8 --resident-margin "${MARGIN:-0.5}" \
        --deadline-s "${DEADLINE:-$(( ${#modes[@]} > 1 ? 230 : 470 ))}" "${TOK[@]}" --out /tmp/serve 2>&1 | grep -v "^\[" | tee -a "$LOG"
      for f in serve.json serve.md serve.png; do cp "/tmp/serve/$f" "$OUT/serve-$tag.${f#serve.}" 2>/dev/null; done ;;
    pprof)
      timeout 560 python3 benchmarks/prefill_ttft.py --lengths 131072 --spin-chunk 32768 --sparse-chunks --runs 1 \
        --profile "${TOK[@]}" --out "$OUT/prefill_ttft.json" 2>&1 | grep -v "^\[" | tee -a "$LOG" ;;
    g27) run g27 420 --modes dense spin --shape gemma-3-27b --workloads offline-128K --offline-lengths 131072 \
           --offline-batch 4 --max-num-seqs 4 --output-tokens 256 --max-batched-tokens 32768 --gpu-kv-gib 60 \
           --per-head-shares --sparse-prefill "${PREFILL:-0.125}" ;;
    mixed)
      for pair in ${MIXED:-dense:25 spin:59}; do
        timeout 280 python3 -P -m spin_cluster.bench decode-step --mode "${pair%%:*}" --batch "${pair##*:}" \
          --context "${CTX:-32768}" --mixed "${CTX:-32768}" --steps 5 --gpu-kv-gib "${GPU_KV:-108}" --host-kv-gib 88 --host-kv-dtype fp8 --per-head-shares \
          --resident-margin 0.5 --sparse-prefill 0.125 --max-num-seqs "${MAXSEQS:-64}" --max-batched-tokens 32768 "${TOK[@]}" \
          --out "$OUT" 2>&1 | grep -v "^\[" | tail -45 | tee -a "$LOG"
      done ;;
    q32) run q32 500 --modes dense spin --shape qwen2.5-32b --workloads offline-128K --offline-lengths 131072 \
           --offline-batch "${N32:-4}" --max-num-seqs "${N32:-4}" --output-tokens 256 --max-batched-tokens 32768 \
           --gpu-kv-gib 60 --host-kv-dtype fp8 --per-head-shares --sparse-prefill "${PREFILL:-0.125}" \
           --resident-margin "${MARGIN:-0.5}" ;;
    m1) run m1 480 --modes spin --workloads offline-1024K --offline-lengths 1048576 --offline-batch 1 --max-num-seqs 1 \
          --output-tokens 256 --max-batched-tokens "${M1_CHUNK:-131072}" --gpu-kv-gib 90 --host-kv-dtype fp8 \
          --per-head-shares --buffer-share 8 --sparse-prefill "${PREFILL:-0.125}" --resident-margin 0.5 ;;
    128k) run 128k 230 --modes dense spin --workloads offline-128K --offline-lengths 131072 --offline-batch 4 \
            --gpu-kv-gib 100 --host-kv-gib 72 --per-head-shares ;;
    128ks) run 128ks 230 --modes dense spin --workloads offline-128K --offline-lengths 131072 --offline-batch 4 \
             --gpu-kv-gib 100 --host-kv-gib 72 --per-head-shares --sparse-prefill "${PREFILL:-0.125}" ;;
  esac
done
