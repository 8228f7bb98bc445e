#!/usr/bin/env bash
# Where a decode step's time goes, per mode (device tool, one call): benchmarks/profile_step.py
# at Llama-3.1-8B shapes with every mode given the same GPU memory (GPU_KV_GIB, default 100:
# dense holds all of BATCH requests of CONTEXT tokens). Results land in $OUT:
# gpu.txt, profile-<mode>-<context>.json, profile.log.
# Env: MODES (default "dense spin"), CONTEXT (131072), BATCH (4), GPU_KV_GIB, HOST_KV_GIB (72),
# STEPS (20), EXTRA_ARGS (more profile_step.py flags, e.g. --buffer-share 16).
set -o pipefail
source benchmarks/gpu_setup.sh
gpu_record
for mode in ${MODES:-dense spin}; do
  timeout "${MODE_TIMEOUT:-280}" python3 -P -m spin_cluster.bench decode-step --mode "$mode" --context "${CONTEXT:-131072}" \
    --batch "${BATCH:-4}" --steps "${STEPS:-20}" --gpu-kv-gib "${GPU_KV_GIB:-100}" --host-kv-gib "${HOST_KV_GIB:-72}" \
    ${EXTRA_ARGS} "${TOK[@]}" --out "$OUT" 2>&1 | tee -a "$OUT/profile.log"
done
