"""The import layering in pyproject.toml holds, and breaking it fails the check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = [sys.executable, str(REPO / "tools" / "lint_imports.py")]
SOURCES = ("spin_cluster", "kernels", "deployments", "profiling")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT, "--root", str(root)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in SOURCES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_repository_keeps_every_contract():
    got = _lint(REPO)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "0 broken" in got.stdout


@pytest.mark.parametrize("module, line, contract", [
    # a back-edge: the KV cache reaching up into the engine that uses it
    ("spin_cluster/kvcache/transfer.py", "import spin_cluster.engine.scheduler", "Layers"),
    # a circle inside one package
    ("spin_cluster/engine/scheduler.py", "import spin_cluster.engine.model_runner", "No import circle"),
    # the library importing the serving stack
    ("spin_cluster/engine/scheduler.py", "import ray", "The engine library never imports"),
    # a kernel importing something other than torch, triton, numpy
    ("kernels/page_select.py", "import transformers", "Kernels import only"),
    # a serving algorithm importing a study tool
    ("spin_cluster/sparse/labels.py", "import spin_cluster.profiling.sparq", "Serving modules never import a study"),
    ("deployments/planner.py", "import spin_cluster.profiling.seer_train", "Serving modules never import a study"),
    ("spin_cluster/kvcache/buffer.py", "import spin_cluster.profiling.lru", "Serving modules never import a study"),
])
def test_an_added_back_edge_breaks_its_contract(copy: Path, module: str, line: str, contract: str):
    assert _lint(copy).returncode == 0
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}  # the edge under test\n")
    got = _lint(copy)
    assert got.returncode != 0
    broken = [row for row in got.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(row.startswith(contract) for row in broken), got.stdout
