"""Float32 GEMMs on the CPU through oneDNN with the weight prepacked once.

torch's CPU ``F.linear`` runs float32 through MKL's GEMM, which re-lays out the weight on
every call. At decode's small batches that costs more than reading the weight: on our 2-core
AVX2 machine a [M, 576] x [576, 3072] GEMM takes 0.76 ms at M = 1 (bandwidth-bound), 2.25 ms
at M = 4 and 3.84 ms at M = 16. oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``; the call ``_linear_pointwise``: what torch's
inductor emits for frozen CPU linears, and what vLLM's CPU backend does with its own oneDNN)
takes 1.5 and 2.75 ms there, and the same as MKL at M = 1 and at prefill's M = 512.

One or two rows (a decode step at batch 1 or 2) are the exception: there the plain weight
read straight through is faster than the pack. SmolLM2's 121 GEMMs of a step, one thread, on
a 2-core Xeon with AVX-512: MKL over the plain weight 39.5 ms against 44.4 through the packs
at M = 1, 41.7 against 44.7 at M = 2, but 72.6 against 46.5 at M = 4 and 105 against 68.5 at
M = 16. So a pack hands up to ``_PLAIN_MAX_ROWS`` rows to a plain-weight kernel: the native
``cpu_native.linear_rows`` where it is built, else ``F.linear``. ``linear_rows`` reads each
weight row once for both rows with four FMA chains per row of x, where MKL's GEMV reads the
weight once per row of x: sixty [M, 576] x [576, 3072] weights on the 2-vCPU AVX2 EPYC, one
thread, 8.1 GB/s against MKL's 7.1 at M = 1 and 6.2 against 3.6 at M = 2 (2026-12-04).

The packed copy doubles the memory of the weights it packs; the Linear keeps its own weight
(checkpoint names, sharding, ``state_dict``). A pack is used only while the Linear still
holds the weight it was made from (``current``), so a weight replaced or moved afterwards
falls back to ``F.linear``, never to stale numbers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from spin_cluster.kernels import cpu_native

# The batch the weight's layout is tuned for (decode's range; prefill's large M is
# compute-bound and runs at the same speed with any of them).
_PACK_BATCH = 16
# Rows up to which a plain-weight kernel beats the pack (see the top).
_PLAIN_MAX_ROWS = 2


@functools.cache
def _native_rows() -> bool:
    """``cpu_native.linear_rows`` is built here (and takes the plain weight's few rows)."""
    return cpu_native.available() and _PLAIN_MAX_ROWS <= cpu_native.LINEAR_MAX_ROWS


@functools.cache
def available() -> bool:
    """oneDNN's prepacked linear exists in this torch build and agrees with ``F.linear``."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        x = torch.randn(5, 40, generator=g)
        packed = PackedLinear(w, b)
        return torch.allclose(packed(x), nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError):
        return False


class PackedLinear:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors, the weight packed at creation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH)
        self.bias = None if bias is None else bias.detach()
        self._source = (weight, bias, weight.data_ptr(), weight._version)

    def current(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``weight``/``bias`` are still the tensors (and values) this pack was made of."""
        w, b, ptr, version = self._source
        return weight is w and bias is b and weight.data_ptr() == ptr and weight._version == version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] float32 on the CPU -> [T, out]
        if x.shape[0] <= _PLAIN_MAX_ROWS:  # the plain weight read straight through is faster (see the top)
            weight, bias = self._source[:2]
            if _native_rows() and weight.is_contiguous() and x.stride(-1) == 1:
                return cpu_native.linear_rows(x, weight, bias)
            return nn.functional.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """A pack of a float32 CPU weight (and its bias); None where it cannot have one."""
    if weight.dtype != torch.float32 or weight.is_cuda or not available():
        return None
    return PackedLinear(weight, bias)


def serves(pack: PackedLinear | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``pack`` may compute ``F.linear(x, weight, bias)``: it is current and ``x`` suits it."""
    return (pack is not None and x.dim() == 2 and x.dtype == torch.float32 and not x.is_cuda
            and pack.current(weight, bias))


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through its pack when it has a current one and ``x`` suits it."""
    pack: PackedLinear | None = getattr(module, "cpu_pack", None)
    return pack(x) if serves(pack, x, module.weight, module.bias) else module(x)


def pack(module: nn.Linear) -> bool:
    """Give a float32 CPU ``nn.Linear`` a pack (its ``cpu_pack``); False where it cannot have one."""
    module.cpu_pack = pack_weight(module.weight, module.bias)
    return module.cpu_pack is not None
