"""What serves imports only what it serves: the engine imports no Spin backend, no sparse
algorithm and no study tool until one is chosen by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SPIN_BACKEND = ("spin_cluster.engine.spin_attention", "spin_cluster.engine.hybrid_attention")
ALGORITHMS = tuple(f"spin_cluster.sparse.{name}" for name in
                   ("dense", "streaming", "quest", "shadowkv", "retroinfer", "seer", "seer_gate", "labels", "either"))
STUDY_TOOLS = ("spin_cluster.profiling.oracle", "spin_cluster.profiling.sparq", "spin_cluster.profiling.seer_train")


def imported_by(code: str) -> set[str]:
    """The spin_cluster modules a fresh interpreter holds after running ``code``."""
    show = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('spin_cluster'))))"
    got = subprocess.run([sys.executable, "-c", f"{code}\n{show}"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    return set(json.loads(got.stdout.splitlines()[-1]))


def test_the_engine_imports_no_spin_backend_no_algorithm_and_no_study_tool():
    modules = imported_by("import spin_cluster.engine")
    assert "spin_cluster.engine.engine" in modules
    assert modules.isdisjoint(SPIN_BACKEND + ALGORITHMS + STUDY_TOOLS), sorted(
        modules & set(SPIN_BACKEND + ALGORITHMS + STUDY_TOOLS))


def test_the_paged_backend_leaves_the_spin_backend_unimported():
    modules = imported_by("from spin_cluster.engine.backend import backend_class; backend_class('paged')")
    assert "spin_cluster.engine.paged_attention" in modules
    assert modules.isdisjoint(SPIN_BACKEND)


@pytest.mark.parametrize("name, module", [("quest", "spin_cluster.sparse.quest"),
                                          ("seer", "spin_cluster.sparse.seer"),
                                          ("oracle", "spin_cluster.profiling.oracle")])
def test_an_algorithm_is_imported_when_it_is_named(name: str, module: str):
    modules = imported_by(f"from spin_cluster.sparse import get_algorithm; get_algorithm({name!r})")
    assert module in modules
    others = set(ALGORITHMS + STUDY_TOOLS) - {module, "spin_cluster.sparse.seer_gate"}
    assert modules.isdisjoint(others), sorted(modules & others)


def test_every_listed_name_is_an_algorithm_of_that_name():
    """The registry's table names each algorithm as its class does: every name it lists
    resolves (a wrong key would list a name no class answers to, and hide the real one)."""
    from spin_cluster.sparse import get_algorithm, registered_algorithms

    for name in registered_algorithms():
        assert get_algorithm(name).name == name
