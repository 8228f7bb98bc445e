"""Kernel tests: run Triton kernels under the interpreter when there is no GPU, and make
``spin_cluster.kernels`` importable from a source checkout that is not pip-installed."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
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


def check_impls(launcher, reference, make_args, exact: bool = True, outputs=None) -> None:
    """A launcher's ``impl`` choice on one tiny case: "auto" on CPU tensors gives the
    reference's result (on CUDA the kernel's), "triton" (the interpreter on the CPU) equals
    "torch", and an unknown name raises naming the choices. ``make_args()`` returns fresh
    (args, kwargs) each call: launchers that write in place are compared by their arguments
    too; ``outputs(result, args)`` picks what to compare where that is not all of it.
    ``exact=False``: floats compared with assert_close (the kernel sums in its order)."""

    def run(fn, **impl):
        args, kwargs = make_args()
        result = fn(*args, **kwargs, **impl)
        return outputs(result, args) if outputs else [result, args]

    def same(a, b, exact):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            if exact or not a.is_floating_point():
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b)
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y, exact)
        else:
            assert a == b

    args, _ = make_args()
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in args)
    kernel = run(launcher, impl="triton")
    same(run(launcher), kernel if on_cuda else run(reference), exact=True)
    same(kernel, run(launcher, impl="torch"), exact)
    with pytest.raises(ValueError, match="impl='cuda': choose one of 'auto', 'triton', 'torch'"):
        run(launcher, impl="cuda")
