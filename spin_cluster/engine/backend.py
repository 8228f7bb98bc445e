"""The attention backend: what the model runner calls, and the registry it is chosen from.

A backend owns one KV cache's attention for the model's layers. Per step the runner calls
``begin_step`` once (the step plan: page ids, slots, Select plans, built from the step's
device tensors), then ``forward`` per layer, then ``end_step``; ``decode_graphs`` offers CUDA
graphs of decode-only steps when the backend's step can be captured::

    paged   GPU-only pages, dense attention (``paged_attention.PagedAttention``)
    spin    the offloaded cache: Offload, Index, Select, Retrieve, Attention
            (``spin_attention.SpinAttention``)

Head-parallel ranks wrap one of these (``spin_cluster.parallel.attention``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

_BACKENDS: dict[str, type["AttentionBackend"]] = {}


class AttentionBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def row(self, request_id: str) -> int:
        """The request's row in the cache's tables (what ``begin_step``'s token rows hold)."""

    @abstractmethod
    def begin_step(self, chunks, positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        """Plan the step: chunks in the runner's order, [T] positions and token rows."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], the step's new k, v [T, Hkv, D] -> [T, H, D]."""

    @abstractmethod
    def end_step(self) -> None: ...

    def decode_graphs(self, model: torch.nn.Module, max_batch: int, progress: bool = False):
        """CUDA graphs of decode-only steps over this backend, or None (none can be captured)."""
        return None


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"no attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]
