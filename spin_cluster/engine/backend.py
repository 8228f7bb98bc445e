"""The attention backend: what the model runner calls, and the registry it is chosen from.

A backend owns one KV cache's attention for the model's layers. Per step the runner calls
``begin_step`` once (the step plan: page ids, slots, Select plans, built from the step's
device tensors), then ``forward`` per layer, then ``end_step``; ``decode_graphs`` offers CUDA
graphs of decode-only steps when the backend's step can be captured::

    paged   GPU-only pages, dense attention (``paged_attention.PagedAttention``)
    spin    the offloaded cache: Offload, Index, Select, Retrieve, Attention
            (``spin_attention.SpinAttention``)
    hybrid  sliding-window layers paged, the others Spin (``hybrid_attention.HybridAttention``)

A KV cache names its backend (``KVCache.attention_backend``); ``backend_class`` resolves the
name, importing the backend's module only when it is first chosen (no registration by import
side effect), and ``build`` makes one over a built cache from the ``BackendParts`` the cache
builder gathered. Head-parallel ranks wrap one of these (``spin_cluster.parallel.attention``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from spin_cluster.config import SparseConfig
    from spin_cluster.dense_attention import SparsePrefill
    from spin_cluster.sparse import SparseAlgorithm

# name -> the class, or "module:Class" until first chosen.
_BACKENDS: dict[str, Any] = {
    "paged": "spin_cluster.engine.paged_attention:PagedAttention",
    "spin": "spin_cluster.engine.spin_attention:SpinAttention",
    "hybrid": "spin_cluster.engine.hybrid_attention:HybridAttention",
}


@dataclass(frozen=True)
class BackendParts:
    """What a backend is built from besides its cache; each backend takes what it needs."""

    sparse: SparseConfig
    max_model_len: int
    decode_attention: str = "auto"  # ``dense_attention.decode_impl``'s names
    algorithm: SparseAlgorithm | None = None  # the sparse algorithm (the offloaded cache's)
    prefill: SparsePrefill | None = None  # block-sparse prefill; None: dense


class AttentionBackend(ABC):
    name: ClassVar[str]

    @classmethod
    def build(cls, kv, parts: BackendParts) -> AttentionBackend:
        """This backend over the cache ``kv``; a backend that only wraps another (a
        head-parallel rank's) is built by its owner instead."""
        raise TypeError(f"attention backend {cls.__name__} is not built from a cache")

    @abstractmethod
    def row(self, request_id: str) -> int:
        """The request's row in the cache's tables (what ``begin_step``'s token rows hold)."""

    @abstractmethod
    def begin_step(self, chunks, positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        """Plan the step: chunks in the runner's order, [T] positions and token rows."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        """q [T, H, D], the step's new k, v [T, Hkv, D] -> [T, H, D]; ``window``: a
        sliding-window layer's (``LayerAttention``)."""

    @abstractmethod
    def end_step(self) -> None: ...

    def decode_graphs(self, model: torch.nn.Module, max_batch: int, progress: bool = False):
        """CUDA graphs of decode-only steps over this backend, or None (none can be captured)."""
        return None


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"no attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}")
    target = _BACKENDS[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = _BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return target
