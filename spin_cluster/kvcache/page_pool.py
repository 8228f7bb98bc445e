"""Physical per-head KV pages on one memory tier, and their free list.

A page holds ``page_size`` consecutive tokens of ONE (layer, KV head) of one request::

    k_pages[page_id] : [S, D]      v_pages[page_id] : [S, D]

Pages of every layer and head share one pool, so a page is the unit that a later tier
(host memory) and a sparse Select can move or skip independently. The pool knows nothing
about requests: it hands out ids and takes them back.
"""

from __future__ import annotations

import torch

from spin_cluster.kvcache.free_list import FreeList


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        # [N + 1, S, D] each. The last page is never handed out: padding tokens of a
        # fixed-size batch (a CUDA graph's) write their K/V there instead of into a request's.
        self.k_pages = torch.zeros(num_pages + 1, page_size, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages + 1, page_size, head_dim, dtype=dtype, device=device)
        self.scratch_page_id = num_pages
        self.free_list = FreeList(num_pages)

    @staticmethod
    def bytes_per_page(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one page."""
        return 2 * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_list)

    def can_allocate(self, n: int) -> bool:
        return self.free_list.can_take(n)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"page pool exhausted: asked {n}, {self.num_free} free")
        return self.free_list.take(n)

    def free(self, page_ids: list[int]) -> None:
        self.free_list.give(page_ids)
