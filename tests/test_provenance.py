"""Result files name their code: commit, command, GPU, date and versions."""

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
    assert set(p) == {"commit", "command", "gpu", "date", "torch", "triton"}
    assert p["command"].endswith("benchmarks/x.py --out r.json") and p["torch"] == torch.__version__
    assert p["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert p["date"].endswith("+00:00")
