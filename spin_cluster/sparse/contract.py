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
    # True when ``plan_append``, ``append``, ``score`` and ``select_top`` are fixed-shape
    # device work with no host sync and no per-step Python state, so that a CUDA graph of a
    # decode step can capture them (``model.cuda_graphs`` on the offloaded cache). Such an
    # algorithm also serves row ``max_seqs``, the cache's padding row
    # (``OffloadedKVManager.padding_row``): one token at position 0, which an index per row
    # keeps in its last entry (the one that absorbs masked-off writes) and a paged index
    # (``index_page_ids``) in the page the cache gives it.
    graph_safe: ClassVar[bool] = False
    # True when the index is kept per logical page and addressed through ``index_page_ids``,
    # so that it can be sized by the pages the cache holds (``index_pages``, ``bind_pages``)
    # rather than by max_seqs x max_pages_per_seq.
    paged_index: ClassVar[bool] = False
    # The index dtypes the algorithm's kernels take (``sparse.options.index_dtype``). An 8-bit
    # float is for an index that is read as values (``labels``); bounds (Quest) must round
    # outward, which their kernels do for the 16-bit types only.
    index_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_seqs: int, max_pages_per_seq: int, device: torch.device,
                 index_dtype: torch.dtype | str = torch.float32, index_pages: int | None = None,
                 model_layers: Sequence[int] | None = None) -> None:
        """index_pages: logical pages the index holds, for a ``paged_index`` algorithm whose
        pages the cache hands out (``bind_pages``); None: one per (request row, page).
        ``model_layers``: the model's layer id of each of the ``num_layers`` layers this
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
        self.index_dtype = _index_dtype(index_dtype, self.index_dtypes, self.name)
        if index_pages is not None and not self.paged_index:
            raise ValueError(f"sparse algorithm {self.name!r} keeps its index per request row: it takes no index_pages")
        self.num_index_pages = max_seqs * max_pages_per_seq if index_pages is None else index_pages
        self._logical_ids: torch.Tensor | None = None  # [R, n_seg] index segment of (row, segment); -1: none
        self._segment_pages = 1

    def bind_pages(self, logical_ids: torch.Tensor, segment_pages: int) -> None:
        """The cache's map of (request row, segment of ``segment_pages`` logical pages) ->
        index segment (-1: none yet), [R, n_seg] int on the device, updated in place as
        requests grow and leave; index page = segment * segment_pages + page % segment_pages."""
        if not self.paged_index:
            raise ValueError(f"sparse algorithm {self.name!r} keeps its index per request row")
        self._logical_ids, self._segment_pages = logical_ids, segment_pages

    def index_page_ids(self, rows: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Index page of logical page ``pages`` of request row ``rows`` (broadcast together;
        int64, -1 where the cache gave the page none). Unbound: row * max_pages_per_seq + page.
        No host sync, fixed shapes (CUDA graphs capture it)."""
        if self._logical_ids is None:
            return rows * self.max_pages_per_seq + pages
        E = self._segment_pages
        seg = self._logical_ids[rows, pages // E].long()
        return torch.where(seg >= 0, seg * E + pages % E, -1)

    def on_append(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
        """Index: K of new tokens. rows [T] request rows, positions [T], k [T, Hkv, D].

        Called by Offload for prefill chunks and decode tokens alike. Default: no index.
        """

    def index_bytes_per_token(self) -> float:
        """Bytes of index one Select reads per context token of a request, over every layer
        and KV head (the step's byte budget: ``benchmarks/e2e.py``'s roofline). Default: none."""
        return 0.0

    def index_bytes_held_per_token(self) -> float:
        """Bytes of index the GPU holds per context token, over every layer and KV head (what
        the cache's memory split sets aside). Default: what one Select reads."""
        return self.index_bytes_per_token()

    def plan_append(self, rows: torch.Tensor, positions: torch.Tensor, decode_only: bool = False):
        """Once per step, before any layer's ``append``: whatever ``append`` needs from the
        step's [T] token rows and positions, computed once instead of once per layer.
        ``decode_only``: every token is the newest of its request, one per request (a decode
        step), so an algorithm whose Select brings up to date what a decode token changes may
        leave that to it. Default: the two tensors themselves."""
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

    def select_top(self, layer: int, q: torch.Tensor, rows: torch.Tensor, plan,
                   held: torch.Tensor | None, margin: float,
                   force: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Select whole under the top-k rule, in the algorithm's own kernels: exactly what
        ``score``, ``margin`` (score units) added to the ``held`` [B, Hkv, P] pages and
        ``select_pages`` return for the layer's ``SelectPlan`` (want [B, Hkv, W],
        num_selected [B, Hkv]), or None to leave it to them (the default; also where the
        algorithm's kernels are slower at this shape, unless ``force``)."""
        return None


_INDEX_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float8_e4m3fn": torch.float8_e4m3fn}


def _index_dtype(value: torch.dtype | str, allowed: Sequence[str], name: str) -> torch.dtype:
    dtype = _INDEX_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in [_INDEX_DTYPES[a] for a in allowed]:
        raise ValueError(f"sparse.options.index_dtype={value!r}: {name} takes one of {', '.join(allowed)}")
    return dtype


# Filled by ``@register`` as each algorithm's module is imported (``spin_cluster.sparse.get_algorithm``
# imports a built-in one the first time its name is asked for); looked up by name through it.
REGISTRY: dict[str, type[SparseAlgorithm]] = {}


def register(cls: type[SparseAlgorithm]) -> type[SparseAlgorithm]:
    REGISTRY[cls.name] = cls
    return cls
