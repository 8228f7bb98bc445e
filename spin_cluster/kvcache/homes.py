"""Where each KV page lives: the GPU and the host as one capacity.

A page's *home* is where its K/V are kept. It is on the GPU while there is room there and
moves to the host only when the GPU must make room (``OffloadedKVManager.spill``); the GPU
buffer (``buffer.py``) caches host pages that Select picks. So the cache holds what the GPU's
home pages *and* the host tier hold, where a host-only home held what the host holds.

Homes are handed out in segments of E consecutive pages of one (request, layer, KV head), as
the page table's second level needs (``directory.py``). Segment ids of both tiers share one
space, host segments first::

    segment id   0 .. Nh-1          host segment (host pages seg*E .. seg*E+E-1)
                 Nh .. Nh+Ng-1      GPU segment

    page id u = seg * E + i         u <  Nh*E: host page u
                                    u >= Nh*E: GPU page, slot u - Nh*E + gpu_slot_base of the
                                               GPU page array (after the buffer's slots)

so that the directory, its lookups and the Retrieve kernels keep one integer per segment, and
a page id tells its tier by one comparison. Host-only homes (Ng = 0) are the same cache with
no GPU segments; a GPU-only cache is the same cache with Nh = 0.
"""

from __future__ import annotations

import torch

from spin_cluster.kvcache.free_list import FreeList, check_partition
from spin_cluster.kvcache.host_tier import HostTier


class PageHomes:
    def __init__(self, host: HostTier, num_gpu_segments: int, gpu_slot_base: int, device: torch.device | str) -> None:
        """gpu_slot_base: the GPU page array's slot of GPU page 0 (its slots before it are the
        buffer's)."""
        self.host = host
        self.segment_pages = host.segment_pages
        self.num_host_segments = host.num_segments
        self.num_gpu_segments = num_gpu_segments
        self.gpu_free = FreeList(num_gpu_segments)
        # First GPU page id, and what to add to a GPU page id for its slot.
        self.first_gpu_page = host.num_segments * host.segment_pages
        self.gpu_slot_offset = gpu_slot_base - self.first_gpu_page
        # Step of the last Select that picked a page of each GPU segment (the spill order:
        # coldest first); one extra entry takes the writes of host pages and padding.
        self.gpu_last_use = torch.zeros(num_gpu_segments + 1, dtype=torch.int32, device=device)

    # ---- capacity (segments) -----------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        return self.num_host_segments + self.num_gpu_segments

    @property
    def num_free_segments(self) -> int:
        return len(self.gpu_free) + self.host.num_free_segments

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_segments

    def allocate(self, n: int) -> list[int]:
        """n segment ids, GPU ones first (a page is born on the GPU while there is room)."""
        if not self.can_allocate(n):
            raise RuntimeError(f"KV homes exhausted: asked {n} segments, {self.num_free_segments} free")
        on_gpu = min(n, len(self.gpu_free))
        gpu = [self.num_host_segments + g for g in self.gpu_free.take(on_gpu)]
        return gpu + self.host.allocate(n - on_gpu)

    def mark_used(self, segment_ids: list[int]) -> None:
        """New segments count as used by the latest step, so that a page just born is not the
        first to spill."""
        gpu = [s - self.num_host_segments for s in segment_ids if s >= self.num_host_segments]
        if gpu:
            idx = torch.tensor(gpu, device=self.gpu_last_use.device)
            self.gpu_last_use[idx] = self.gpu_last_use.max()

    def free(self, segment_ids: list[int]) -> None:
        self.host.free([s for s in segment_ids if s < self.num_host_segments])
        self.gpu_free.give([s - self.num_host_segments for s in segment_ids if s >= self.num_host_segments])

    def is_gpu(self, segment_id: int) -> bool:
        return segment_id >= self.num_host_segments

    def check(self, owned: list[int]) -> None:
        """Every segment of both tiers is owned once or free."""
        split = self.num_host_segments
        check_partition([s for s in owned if s < split], self.host.free_list, "host segments")
        check_partition([s - split for s in owned if s >= split], self.gpu_free, "GPU segments")

    # ---- page ids, on the device, fixed shapes ----------------------------------------------

    def gpu_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Page ids (any shape, int64; < 0 padding) -> GPU page array slots, -1 for host pages
        and padding."""
        return torch.where(pages >= self.first_gpu_page, pages + self.gpu_slot_offset, -1)

    def on_gpu(self, table: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Directory entries [..., n_seg] (``directory.py``) -> [..., num_pages] bool: which of
        pages 0 .. num_pages - 1 live at home on the GPU. No host sync."""
        logical = torch.arange(num_pages, device=table.device) // self.segment_pages
        return table[..., logical] >= self.num_host_segments

    def split_token_slots(self, flat: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat token slots (page id * S + offset, any shape) -> (GPU array flat slots, host
        flat slots), each -1 where the token's page lives in the other tier."""
        on_gpu = flat >= self.first_gpu_page * page_size
        return (torch.where(on_gpu, flat + self.gpu_slot_offset * page_size, -1),
                torch.where(on_gpu, -1, flat))
