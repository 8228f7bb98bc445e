"""The one distribution maps four top-level folders into the spin_cluster namespace."""

import importlib
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_mapped_packages_resolve_inside_this_repo():
    for name, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        mod = importlib.import_module(name)
        assert Path(mod.__file__).resolve().parent == (REPO / folder).resolve(), name


def test_every_package_folder_is_listed():
    cfg = _pyproject()["tool"]["setuptools"]
    listed = set(cfg["packages"])
    roots = {folder: name for name, folder in cfg["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_console_script_points_at_cli():
    assert _pyproject()["project"]["scripts"]["spin-cluster"] == "spin_cluster.cli:main"


def test_cpu_setup_pins_torch_and_pyproject_keeps_a_range():
    assert "TORCH_SPEC ?= torch==2.13.0" in (REPO / "Makefile").read_text()
    torch_req = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert torch_req and "==" not in torch_req[0]
