"""An engine capped at AVX2 (torch's ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA and our
kernels' SPIN_CLUSTER_CPU_ISA: what `benchmarks/cpu_serving.py --isa avx2` sets for both
servers) gives the greedy tokens of the uncapped one. Each runs in a process of its own:
torch reads its cap once, when it loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spin_cluster.bench.cpu_isa import isa_environment
from spin_cluster.kernels import cpu_native

pytestmark = pytest.mark.timeout(300)

_GENERATE = """
import json, sys
import torch
from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kernels import cpu_native

engine = Engine(SpinConfig.from_dict({"model": {"path": sys.argv[1], "device": "cpu", "dtype": "float32"}}))
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village"]
outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in outs], "kernels": cpu_native.isa() if cpu_native.available() else None,
                  "torch": torch.backends.cpu.get_cpu_capability()}))
"""


def _generate(model_path: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _GENERATE, model_path], capture_output=True, text=True,
                          timeout=240, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif("avx2" not in cpu_native.cpu_isas(), reason="this CPU has no AVX2")
def test_capped_at_avx2_the_engine_gives_the_same_tokens(smollm2_path):
    own = _generate(smollm2_path, {})
    capped = _generate(smollm2_path, isa_environment("avx2"))
    print(f"own ISA: torch {own['torch']}, kernels {own['kernels']}; capped: torch {capped['torch']}, "
          f"kernels {capped['kernels']}")
    assert capped["torch"] == "AVX2"
    assert capped["kernels"] in ("avx2", None)  # None: no C compiler, the torch paths
    assert capped["tokens"] == own["tokens"]
