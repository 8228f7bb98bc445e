"""Kernel tests: run Triton kernels under the interpreter when there is no GPU, and make
``spin_cluster.kernels`` importable from a source checkout that is not pip-installed."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

# TRITON_INTERPRET is read when a kernel is decorated, so it must be set before any
# @triton.jit module is imported -- conftest runs before the test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _alias_kernels_package() -> None:
    """Load the top-level ``kernels/`` folder as ``spin_cluster.kernels`` (what pyproject's
    package-dir maps it to once installed). Loaded by path, not by ``import kernels``, so an
    unrelated PyPI package named ``kernels`` cannot shadow it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    import spin_cluster

    pkg_dir = os.path.join(root, "kernels")
    spec = importlib.util.spec_from_file_location(
        "spin_cluster.kernels",
        os.path.join(pkg_dir, "__init__.py"),
        submodule_search_locations=[pkg_dir],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["spin_cluster.kernels"] = module
    spec.loader.exec_module(module)
    spin_cluster.kernels = module


try:
    import spin_cluster.kernels  # noqa: F401  (installed package)
except ImportError:
    _alias_kernels_package()
