"""What every kernel launcher needs around Triton: a lazy import of its kernel module (the
torch references must work without Triton), and whether kernels run under the interpreter
(``TRITON_INTERPRET=1``: CPU tensors allowed, some language limits worked around)."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


@functools.lru_cache(maxsize=None)
def load_kernel_module(module: str, needed_by: str, reference: str) -> ModuleType:
    """Import ``kernels.<module>`` (a file of ``@triton.jit`` bodies; a dotted name: that module)
    on first use; a RuntimeError naming the torch ``reference`` when Triton is missing or broken."""
    try:
        return importlib.import_module(module if "." in module else f"{__package__}.{module}")
    except ImportError as e:
        raise RuntimeError(f"{needed_by} needs Triton, which could not be imported ({e}); use {reference} instead") from e


def triton_importable(module: str, needed_by: str, reference: str) -> bool:
    try:
        load_kernel_module(module, needed_by, reference)
    except RuntimeError:
        return False
    return True


def is_interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` function was built for the interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
