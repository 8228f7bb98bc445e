# Sourced by the accuracy scripts (gpu_gemma_accuracy.sh, gpu_qwen_accuracy.sh) from the repo root.
#   accuracy_setup ON_DEVICE   OUT made absolute; ON_DEVICE=1: the device machine's setup
#                              (gpu_setup.sh) and its GPU recorded in $OUT/gpu.txt, PY=python3;
#                              else this checkout's .venv (the scripts at toy size on the CPU)
#   prepared_model NAME        `spin-cluster models prepare NAME` from /tmp (the installed package,
#                              not the repository's unmapped folders); prints the folder, or the
#                              reason and returns 1
# Qwen2.5's 128K context (its model card): YaRN at factor 4 over 32K, as model.hf_overrides
# (eval's and e2e.py's --hf-overrides) for every run past 32K.
YARN='{"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'

accuracy_setup() {
  : "${OUT:?set OUT to the results folder}"
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  if [ "$1" = 1 ]; then
    source benchmarks/gpu_setup.sh
    gpu_record "$OUT/gpu.txt"
    PY=python3
  else
    PY=${PY:-$(pwd)/.venv/bin/python}
  fi
}

prepared_model() {
  local folder
  folder=$(cd /tmp && "$PY" -c "from spin_cluster.model_store import prepare_model as p; print(p('$1'))" 2>&1 | tail -1)
  [ -d "$folder" ] || { echo "$1 could not be prepared: $folder" >&2; return 1; }
  echo "$folder"
}
