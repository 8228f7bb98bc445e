"""Offload and Retrieve: the system's two operations of the Spin pipeline, and their streams.

    Offload    new K/V rows -> their host pages (every page's home), on a side stream beside
               the layer's compute; inside a CUDA graph, on the graph's own stream (a decode
               step's few KB need no overlap, and a graph must not wait on work outside it)
    write      K/V rows -> GPU buffer slots (the decode token's write-through, prefill's
               installed pages), on the compute stream
    Retrieve   host pages -> GPU buffer slots or a gather buffer, one zero-copy gather launch
               reading pinned host memory (the misses of a step, a prefill chunk's context)

Before a Retrieve reads host pages that this step's Offload wrote (a later prefill chunk's
own context), ``wait_offload`` orders it after the side stream; ``end_step`` waits for every
Offload of the step. On the CPU the same calls run the torch references in order.
"""

from __future__ import annotations

import torch

from spin_cluster.kernels import offload, retrieve
from spin_cluster.kvcache.host_tier import HostTier


class Transfer:
    def __init__(self, host: HostTier, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.write = offload.write_tokens  # (dst_k, dst_v, k, v, slots)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offload(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [M, D] rows into the host tier at flat token slots [M] (host page * S + offset)."""
        host = self.host
        if self._side is None or torch.cuda.is_current_stream_capturing():
            self.write(host.k_pages, host.v_pages, k, v, slots)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self.write(host.k_pages, host.v_pages, k, v, slots)
        for t in (k, v, slots):
            t.record_stream(self._side)

    def retrieve(self, host_pages: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Host pages [M] (-1: skip) -> pages dst_ids [M] of dst_k / dst_v [N, S, D]."""
        retrieve.retrieve_pages(self.host.k_pages, self.host.v_pages, dst_k, dst_v, host_pages, dst_ids)

    def wait_offload(self) -> None:
        """Order the compute stream after every Offload issued so far."""
        if self._side is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_stream(self._side)
