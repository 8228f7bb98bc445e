"""The host tier: the home of every KV page when the cache is offloaded.

Pages live in pinned host memory (plain host memory on CPU-only machines), and are handed
out in *segments* of E consecutive pages of one (request, layer, KV head)::

    host_k[seg * E + i] : [S, D]    page i of segment seg

Allocating by segment is what lets the page table's second level be implicit (a
segment's pages are contiguous, so one id per segment locates all of them; see
``directory.py``) and lets the GPU gather kernel read the host pages directly through
unified addressing.

With ``dtype`` float8_e4m3fn (``cache.host_kv_dtype: fp8``) the pages hold FP8 K and V with
a float32 scale per token row beside them (``kernels/fp8_pages.py``): half the host bytes
and half the PCIe bytes of a miss. ``write`` and ``read`` quantise and dequantise on the way
in and out, so that callers see the model's dtype either way.

The tier is one allocation of exactly ``nbytes`` (what the memory plan counted, and what
``/metrics`` reports as ``spin_kv_allocated_bytes{tier="host"}``), carved into views::

    memory: [ k_pages | v_pages | k_scale | v_scale ]   (the scales with FP8 only)
"""

from __future__ import annotations

import math
import weakref

import torch

from spin_cluster.kernels.fp8_pages import FP8_DTYPE, retrieve_pages_fp8, write_tokens_fp8
from spin_cluster.kernels.offload import write_tokens
from spin_cluster.kernels.retrieve import retrieve_pages
from spin_cluster.kvcache.free_list import FreeList


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of exactly its own size.

    ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which
    rounds every block up to a power of two: a 36 GiB tier asks the driver for 64 GiB and a
    72 GiB cache fails on a 128 GiB machine. Plain host memory registered with the driver
    (``cudaHostRegister``) pins exactly what it holds; it is unregistered when the tensor is
    collected."""
    t = torch.zeros(shape, dtype=dtype)  # zeros: a page's unwritten tail must not hold NaN bit patterns
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"could not pin {nbytes / 2**30:.1f} GiB of host memory for the KV host tier (CUDA error {int(err)}); "
            "lower cache.host_kv_gib"
        )
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def _carve(memory: torch.Tensor, parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Consecutive views of the uint8 ``memory``, one per (shape, dtype), that fill it."""
    views, offset = [], 0
    for shape, dtype in parts:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        views.append(memory[offset:offset + size].view(dtype).view(shape))
        offset += size
    assert offset == memory.numel(), (offset, memory.numel())
    return views


class HostTier:
    def __init__(
        self,
        num_segments: int,
        segment_pages: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
        allow_empty: bool = False,
    ) -> None:
        """allow_empty: a tier of no segments (the GPU holds every page: ``homes.py``)."""
        if num_segments < 1 and not (allow_empty and num_segments == 0):
            raise ValueError(
                f"the host KV tier needs at least one segment of {segment_pages} pages; "
                f"raise cache.host_kv_gib"
            )
        self.num_segments = num_segments
        self.segment_pages = segment_pages
        self.page_size = page_size
        self.fp8 = dtype == FP8_DTYPE
        self.nbytes = num_segments * self.bytes_per_segment(segment_pages, page_size, head_dim, dtype)
        # One piece: one size to plan, pin and report, and the memory the process holds for
        # the tier is that size (the parts are views of it).
        zeros = pinned_zeros if pin_memory else (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        self.memory = zeros((self.nbytes,), torch.uint8)  # kept: the views below do not hold the pin
        n = num_segments * segment_pages
        views = _carve(self.memory, [((n, page_size, head_dim), dtype)] * 2
                       + [((n, page_size), torch.float32)] * (2 if self.fp8 else 0))
        # [N_host, S, D] each
        self.k_pages, self.v_pages = views[:2]
        # [N_host, S] float32 each: the FP8 rows' scales (None for pages in the model's dtype)
        self.k_scale, self.v_scale = views[2:] if self.fp8 else (None, None)
        self.free_list = FreeList(num_segments)
        self.page_bytes = self.bytes_per_segment(1, page_size, head_dim, dtype)

    @staticmethod
    def bytes_per_segment(segment_pages: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes of a segment in host memory (FP8: with their per-row scales)."""
        row = head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == FP8_DTYPE else 0)
        return segment_pages * 2 * page_size * row

    # ---- moving K/V in and out, in the model's dtype ----------------------------------------

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, also=None) -> None:
        """k, v [M, D] rows into flat token slots [M] (page * S + offset; < 0 skips); ``also``
        (dst_k, dst_v, slots): the same rows to another destination (the GPU home pages) in the
        same launch."""
        if self.fp8:
            write_tokens_fp8(self.k_pages, self.v_pages, self.k_scale, self.v_scale, k, v, slots, also)
        else:
            write_tokens(self.k_pages, self.v_pages, k, v, slots, also)

    def read(self, pages: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, dst_ids: torch.Tensor,
             rows=None) -> None:
        """Host pages [M] (< 0 skips) -> pages dst_ids [M] of dst_k / dst_v [N, S, D]; ``rows``
        (k, v [R, D], flat token slots [R]): written through into dst after the pages, in the
        same launch (``kernels/retrieve.py``'s contract)."""
        if self.fp8:
            retrieve_pages_fp8(self.k_pages, self.v_pages, self.k_scale, self.v_scale, dst_k, dst_v, pages, dst_ids,
                               rows)
        else:
            retrieve_pages(self.k_pages, self.v_pages, dst_k, dst_v, pages, dst_ids, rows=rows)

    @property
    def num_free_segments(self) -> int:
        return len(self.free_list)

    def can_allocate(self, n: int) -> bool:
        return self.free_list.can_take(n)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"host KV tier exhausted: asked {n} segments, {self.num_free_segments} free")
        return self.free_list.take(n)

    def free(self, segment_ids: list[int]) -> None:
        self.free_list.give(segment_ids)
