"""Result files name their code and machine: commit, command, GPU, CPU, date and versions."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from spin_cluster import provenance

REPO = Path(__file__).resolve().parent.parent


def test_the_commit_is_the_checkouts_head():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:  # a copy of the tree without .git
        return
    assert provenance.commit() == head.stdout.strip()


def test_a_tree_without_git_takes_the_commit_from_spin_commit_else_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "_CHECKOUT", tmp_path)
    monkeypatch.delenv("SPIN_COMMIT", raising=False)
    assert provenance.commit() == "unknown"
    monkeypatch.setenv("SPIN_COMMIT", "0123abc")
    assert provenance.commit() == "0123abc"


def test_write_json_adds_the_provenance_and_puts_a_list_under_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--out", "r.json"])
    provenance.write_json(tmp_path / "a.json", {"speedup": 2.0})
    provenance.write_json(tmp_path / "b.json", [{"row": 1}])
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["speedup"] == 2.0 and b["rows"] == [{"row": 1}]
    p = a["provenance"]
    assert set(p) == {"commit", "command", "gpu", "cpu", "date", "torch", "triton"}
    assert p["command"].endswith("benchmarks/x.py --out r.json") and p["torch"] == torch.__version__
    assert p["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert p["date"].endswith("+00:00")


SAMPLE_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
cpu MHz\t\t: 3700.042
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu
"""


def test_the_cpu_is_named_with_the_features_that_choose_kernels():
    info = provenance.cpu_info(SAMPLE_CPUINFO)
    assert info["model"] == "AMD EPYC 9R14 96-Core Processor"
    assert info["features"] == ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]  # no AMX
    assert info["mhz"] == 3700 and info["cpus"] >= 1 and info["machine_cpus"] >= info["cpus"]
    line = provenance.cpu_line(info)
    assert line.startswith("AMD EPYC 9R14 96-Core Processor; ") and "avx512f" in line and "3700 MHz" in line
    assert provenance.cpu_info("")["model"] is None and provenance.cpu_line(provenance.cpu_info(""))


def test_every_result_names_this_machines_cpu():
    cpu = provenance.provenance()["cpu"]
    assert set(cpu) == {"model", "features", "cpus", "machine_cpus", "mhz"}
    if Path("/proc/cpuinfo").exists():
        assert cpu["model"]
