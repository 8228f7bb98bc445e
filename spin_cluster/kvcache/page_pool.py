"""Physical per-head KV pages on one memory tier, and their free list.

A page holds ``page_size`` consecutive tokens of ONE (layer, KV head) of one request::

    k_pages[page_id] : [S, D]      v_pages[page_id] : [S, D]

Pages of every layer and head share one pool, so a page is the unit that a later tier
(host memory) and a sparse Select can move or skip independently. The pool knows nothing
about requests: it hands out ids and takes them back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

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
        self.k_pages = _zeroed_pages(num_pages + 1, page_size, head_dim, dtype, device)
        self.v_pages = _zeroed_pages(num_pages + 1, page_size, head_dim, dtype, device)
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


_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    """libc's madvise where the OS has transparent huge pages (Linux), else None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _zeroed_pages(n: int, page_size: int, head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[n, S, D] zeros. On the CPU the memory is advised into transparent huge pages before
    it is first written: a decode step reads its pages scattered over the pool, one 4 KB
    page of the OS for each KV page, and every one of them missed the TLB (a 16-row step of
    SmolLM2 at 580 tokens, 2 GiB of float16 pages, one thread: the attention's 30 layers took
    27-32 ms on 4 KB pages, 23-24 ms on 2 MB ones; float32 pages 39 and 32-33). Where the OS keeps huge pages for processes
    that ask (``madvise``, Debian's default) nothing else asks for them. torch's own switch
    (``THP_MEM_ALLOC_ENABLE``) is read once, at the process's first allocation, and applies
    to all of them: an engine made inside a running process cannot turn it on."""
    pages = torch.empty(n, page_size, head_dim, dtype=dtype, device=device)
    madvise = _madvise() if pages.device.type == "cpu" else None
    if madvise is not None:
        start = pages.data_ptr()
        first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        last = (start + pages.numel() * pages.element_size()) // _HUGE_PAGE * _HUGE_PAGE
        if last > first:
            madvise(first, last - first, mmap.MADV_HUGEPAGE)  # advice only: a refusal keeps 4 KB pages
    return pages.zero_()
