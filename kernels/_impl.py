"""The one rule by which every kernel launcher picks its implementation.

    impl="auto"    the Triton kernel on CUDA tensors, the torch reference elsewhere
    impl="triton"  the Triton kernel (on CPU tensors only under ``TRITON_INTERPRET=1``: how
                   the tests run kernels without a GPU)
    impl="torch"   the torch reference (the ``*_ref`` function of the same signature)

Callers pass nothing and get "auto"; the launcher, not the caller, looks at the device.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "triton", "torch")


def resolve_impl(impl: str, device: torch.device) -> str:
    """'triton' or 'torch' for ``impl`` on tensors of ``device``; ValueError for other names."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(map(repr, IMPLS))}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl
