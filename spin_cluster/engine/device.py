"""Where the engine runs and in what precision: ``model.device`` and ``model.dtype`` of the
config turned into torch's objects. Every process that loads the model (an ``Engine``, a
head-parallel worker, a study's bare model) resolves them here, so that "auto" means the same
thing to all of them."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA where it is available, else the CPU. Naming a CUDA device without CUDA is a
    ``ValueError``, not a failure at the first tensor."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
