"""Counting the torch operators a piece of engine work dispatches.

Host overhead per step is roughly proportional to the number of operators dispatched (each
one a Python call, a dispatcher trip and, on CUDA, usually a kernel launch), so the count is
a device-independent measure of it that runs on the CPU. The model, attention backend and
cache do the same per-layer work on either device, apart from kernels that are one Triton
launch on CUDA and a few torch ops in their CPU reference.

    with OpCounter() as ops:
        engine.step()
    ops.total, ops.counts.most_common(5)
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """A dispatch mode that counts every aten operator called under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
