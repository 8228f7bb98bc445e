"""Sparse attention as five operations over per-head KV pages.

    Index      algorithm   keep per-page summaries up to date as K/V are appended
    Select     algorithm   score pages for this step's queries; the system takes the top
                           pages per head within the head's budget, plus sink and local pages
    Attention  system      attend over the selected pages (Triton paged decode, per-head
                           lengths); an algorithm may not replace it in this version
    Offload    system      write new K/V to their pages (and through to the host tier)
    Retrieve   system      bring selected pages missing from the GPU buffer into it

Who mutates what: an algorithm owns only its own index tensors; it never touches pages,
tables or the buffer. The system owns everything else and calls the algorithm at fixed
points with typed arguments (no shared mutable context object).

Shapes: B decode requests, T tokens, H query heads, Hkv KV heads, D head dim, P pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch


class SparseAlgorithm(ABC):
    """Policy: Index + Select. Subclasses register under ``name``."""

    name: ClassVar[str]
    # True when every page is selected (the dense oracle): no scoring, no budget.
    selects_all: ClassVar[bool] = False
    # True when ``plan_append``, ``append`` and ``score`` are fixed-shape device work with no
    # host sync and no per-step Python state, so that a CUDA graph of a decode step can
    # capture them (``model.cuda_graphs`` on the offloaded cache).
    graph_safe: ClassVar[bool] = False

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_seqs: int, max_pages_per_seq: int, device: torch.device,
                 index_dtype: torch.dtype | str = torch.float32, model_layers: Sequence[int] | None = None) -> None:
        """``model_layers``: the model's layer id of each of the ``num_layers`` layers this
        index serves (where the cache serves some of them: the global layers of a model with
        sliding-window ones); None: layers 0 .. num_layers - 1."""
        self.num_layers = num_layers
        self.model_layers = tuple(range(num_layers)) if model_layers is None else tuple(model_layers)
        if len(self.model_layers) != num_layers:
            raise ValueError(f"{len(self.model_layers)} model layer ids for {num_layers} layers")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.device = device
        # Floating dtype of the algorithm's index tensors (``sparse.options.index_dtype``):
        # 16-bit halves the bytes Select reads per step, which at long context is most of them.
        self.index_dtype = _index_dtype(index_dtype)

    def on_append(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
        """Index: K of new tokens. rows [T] request rows, positions [T], k [T, Hkv, D].

        Called by Offload for prefill chunks and decode tokens alike. Default: no index.
        """

    def index_bytes_per_token(self) -> float:
        """Bytes of index one Select reads per context token of a request, over every layer
        and KV head (the step's byte budget: ``benchmarks/e2e.py``'s roofline). Default: none."""
        return 0.0

    def plan_append(self, rows: torch.Tensor, positions: torch.Tensor):
        """Once per step, before any layer's ``append``: whatever ``append`` needs from the
        step's [T] token rows and positions, computed once instead of once per layer.
        Default: the two tensors themselves."""
        return rows, positions

    def append(self, layer: int, plan, k: torch.Tensor) -> None:
        """Index: ``on_append`` with the step's ``plan_append`` result; what the engine calls."""
        self.on_append(layer, *plan, k)

    def on_free(self, row: int) -> None:
        """The request in ``row`` left; forget its index."""

    @abstractmethod
    def score(self, layer: int, q: torch.Tensor, rows: torch.Tensor, num_pages: int) -> torch.Tensor | None:
        """Select: q [B, H, D] -> scores [B, Hkv, num_pages] (higher is more important), or
        None to select no page beyond sink and local ones. Pages past a request's length
        are masked by the system."""


_INDEX_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _index_dtype(value: torch.dtype | str) -> torch.dtype:
    dtype = _INDEX_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in _INDEX_DTYPES.values():
        raise ValueError(f"sparse.options.index_dtype={value!r}: choose one of {', '.join(_INDEX_DTYPES)}")
    return dtype


# Filled by ``@register`` as each algorithm's module is imported (``spin_cluster.sparse`` imports
# the built-in ones); looked up by name through ``spin_cluster.sparse.get_algorithm``.
REGISTRY: dict[str, type[SparseAlgorithm]] = {}


def register(cls: type[SparseAlgorithm]) -> type[SparseAlgorithm]:
    REGISTRY[cls.name] = cls
    return cls
