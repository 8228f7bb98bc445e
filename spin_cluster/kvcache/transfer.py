"""Offload and Retrieve: the system's two operations of the Spin pipeline, and their streams.

    Offload    new K/V rows -> their home pages: a GPU home page on the compute stream (as
               dense writes its cache), a host page on a side stream beside the layer's
               compute; inside a CUDA graph, on the graph's own stream (a decode step's few KB
               need no overlap, and a graph must not wait on work outside it), where both
               tiers' writes are one launch
    write      K/V rows -> GPU buffer slots (prefill's installed pages), on the compute stream
    Retrieve   a decode layer's selected pages -> their GPU buffer slots, whole (``retrieve``),
               in two launches: the resolution (GPU home pages read in place, their slot
               arithmetic: ``homes.py``; for host pages the buffer's lookup, hits and slots for
               the misses by the bucketed LRU; the misses' host pages from the directory, each
               head's attended length and its newest token's slot: ``GpuBuffer.resolve``), then
               one zero-copy gather of the misses from pinned host memory that also writes the
               new token through into its tail slot
    gather     home pages -> a gather buffer (a prefill chunk's context): one launch per tier

Before a Retrieve reads host pages that this step's Offload wrote (a later prefill chunk's
own context), ``wait_offload`` orders it after the side stream; ``end_step`` waits for every
Offload of the step. On the CPU the same calls run the torch references in order.
"""

from __future__ import annotations

import torch

from spin_cluster.kernels import offload, retrieve
from spin_cluster.kernels.buffer_lookup import HomeMap
from spin_cluster.kvcache.buffer import GpuBuffer
from spin_cluster.kvcache.directory import SegmentDirectory
from spin_cluster.kvcache.homes import PageHomes


class Transfer:
    def __init__(self, homes: PageHomes, device: torch.device, buffer: GpuBuffer, directory: SegmentDirectory) -> None:
        self.homes = homes
        self.host = homes.host
        self.device = device
        self.buffer = buffer  # where ``retrieve`` puts pages, and
        self.directory = directory  # where it finds their home pages
        self.write = offload.write_tokens  # (dst_k, dst_v, k, v, slots)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Where Retrieve finds selected pages: the directory, and the GPU homes' slots and stamps.
        self.home_map = HomeMap(directory=directory.directory, segment_pages=directory.segment_pages,
                            page_size=homes.host.page_size, first_gpu_segment=homes.num_host_segments,
                            gpu_slot_offset=homes.gpu_slot_offset,
                            gpu_last_use=homes.gpu_last_use if homes.num_gpu_segments else None)

    @property
    def gpu_homes(self) -> bool:
        """Whether any page lives at home on the GPU (else every page's home is the host)."""
        return self.homes.num_gpu_segments > 0

    def offload(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gpu_slots: torch.Tensor | None = None) -> None:
        """k, v [M, D] rows into their homes: the host tier at flat token slots [M] (host page
        * S + offset, -1: not a host page) and the GPU page array at ``gpu_slots`` [M] (-1:
        not a GPU page; None: no GPU homes). Where both go on one stream (a captured step, or
        the CPU) they are one launch."""
        host = self.host
        home = None if gpu_slots is None else (self.buffer.k_slots, self.buffer.v_slots, gpu_slots)
        if host.num_segments and (self._side is None or torch.cuda.is_current_stream_capturing()):
            host.write(k, v, slots, home)  # both tiers in one launch
            return
        if home is not None:
            self.write(home[0], home[1], k, v, home[2])
        if not host.num_segments:  # no host tier: every page lives on the GPU
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            host.write(k, v, slots)
        for t in (k, v, slots):
            t.record_stream(self._side)

    def retrieve(self, rows: torch.Tensor, layer: int, want: torch.Tensor, num_selected: torch.Tensor,
                 tail_len: torch.Tensor, now: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring layer ``layer``'s selected pages of table rows [B] into the GPU buffer.

        want [B, Hkv, K] page ids (-1 padding) and num_selected [B, Hkv] from Select;
        tail_len [B] tokens in each tail page; now: the step index on the device (the LRU's
        clock); k, v [B * Hkv, D] the decode tokens' new K/V, written through into their tail
        page's slot by the gather's launch, over the page's copy where the tail page is a miss
        (the slot may hold the page without it). Returns
        (slots [B, Hkv, K] buffer slots, -1 padding; lens [B, Hkv] tokens each head attends).
        Device work only, no host sync: a CUDA graph captures it.
        """
        buf = self.buffer
        slots, miss_dst, src, lens, tail_slot = buf.resolve(rows, layer, want, num_selected, tail_len, now, self.home_map)
        # The misses' pairs come as [B * Hkv, K]: a head's K pages, the group of its row.
        self.host.read(src, buf.k_slots, buf.v_slots, miss_dst, rows=(k, v, tail_slot))
        return slots, lens

    def gather(self, pages: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Home pages [M] (page ids, -1: skip) -> pages dst_ids [M] of dst_k / dst_v [N, S, D]:
        host pages over PCIe, GPU home pages from the GPU page array."""
        if not self.gpu_homes:
            self.host.read(pages, dst_k, dst_v, dst_ids)
            return
        at_home = self.homes.gpu_slots(pages)
        on_host = torch.where(at_home >= 0, -1, pages)
        if self.host.num_segments:
            self.host.read(on_host, dst_k, dst_v, dst_ids)
        retrieve.retrieve_pages(self.buffer.k_slots, self.buffer.v_slots, dst_k, dst_v, at_home, dst_ids)

    def wait_offload(self) -> None:
        """Order the compute stream after every Offload issued so far."""
        if self._side is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_stream(self._side)
