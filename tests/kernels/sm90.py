"""Kernels compiled for an H100 (sm_90) on a machine without a GPU, at a launcher's own arguments.

The interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not Triton's compiler: a
kernel that the interpreter runs may still fail to compile (a name rebound to another shape in
an ``if``, a constexpr used as a tensor). Within ``compiled_launches``, a launcher called with
CPU tensors records each launch (its kernel, its arguments' types, its constexprs) instead of
running it; on leaving, one Python process without the interpreter compiles every recorded
launch for sm_90 (``triton.compile`` with a ``GPUTarget``, as ``benchmarks/kernel_sass.py``
does; Triton's NVIDIA backend carries ptxas, so no GPU is needed):

    with compiled_launches("_retrieve_kernel") as launches:
        retrieve_pages(...)             # CPU tensors
    assert [name for _, name, _ in launches] == ["_retrieve_pages"]

A compile error fails the ``with`` block with Triton's message. (The compile runs in its own
process: the interpreter, once loaded, replaces ``triton.language``'s functions.)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

_POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
            torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
            torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for module, name, signature, constexprs, options in json.load(sys.stdin):
    jit = getattr(importlib.import_module("spin_cluster.kernels." + module), name)
    triton.compile(ASTSource(jit, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options=options)
"""


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def launch_record(module: str, kernel, args: tuple, kwargs: dict) -> list:
    """[module, name, signature, constexprs, options] of ``kernel[grid](*args, **kwargs)``."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    params = inspect.signature(kernel.fn).parameters
    values = dict(zip(params, args))
    values.update(kwargs)
    signature, constexprs = {}, {}
    for name, p in params.items():
        value = values[name]
        if "constexpr" in str(p.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = _arg_type(value)
    return [module, kernel.fn.__name__, signature, constexprs, options]


def compile_for_sm90(records: list) -> None:
    """Compile every record in one process without the interpreter; an AssertionError with
    Triton's message when one fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(records), env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise AssertionError("a kernel does not compile for sm_90:\n" + done.stderr[-4000:])


class InterpretedFunction:
    """A kernel's stand-in: ``[grid](...)`` records the launch. (Named as the interpreter's
    kernels are, so that a launcher accepts CPU tensors: ``is_interpreted``.)"""

    def __init__(self, module, kernel, launches):
        self.module, self.kernel, self.launches = module, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(launch_record(self.module, self.kernel, args, kwargs))
        return launch


@contextlib.contextmanager
def compiled_launches(*modules: str):
    """Within: launchers that load ``spin_cluster.kernels.<module>`` record their launches; on
    leaving, each is compiled for sm_90. Yields the records' list."""
    from spin_cluster.kernels import _triton_support

    loader = _triton_support.load_kernel_module
    launches: list = []
    stand_ins = {}
    for name in modules:
        real = loader(name, "compiled_launches", "-")
        stand_ins[name] = SimpleNamespace(**{
            k: InterpretedFunction(name, v, launches) for k, v in vars(real).items() if hasattr(v, "arg_names")})

    def load(module, needed_by, reference):
        return stand_ins.get(module) or loader(module, needed_by, reference)

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "load_kernel_module", None) is loader and m.__name__.startswith("spin_cluster.kernels")]
    for m in patched:
        m.load_kernel_module = load
    try:
        yield launches
    finally:
        for m in patched:
            m.load_kernel_module = loader
    compile_for_sm90(launches)
