"""The offloaded KV cache (Spin): every page's home in host memory, a GPU buffer in front.

Same request-level API as ``KVCacheManager`` (the scheduler cannot tell them apart):
``can_allocate`` / ``allocate`` / ``free`` in token counts, ``check_integrity``. On top,
admission gives each request its buffer share (``buffer.py``), and the attention backend
reads the directory and the buffer once per step and layer.

Capacity: a request is admitted only when its host segments and its mandatory buffer share
fit; otherwise it waits in the queue. A running request that cannot grow preempts the
newest one (the scheduler's rule), so a full host tier never corrupts a running request.
"""

from __future__ import annotations

import torch

from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit
from spin_cluster.kvcache.buffer import GpuBuffer
from spin_cluster.kvcache.directory import SegmentDirectory
from spin_cluster.kvcache.free_list import check_partition
from spin_cluster.kvcache.host_tier import HostTier


class OffloadedKVManager(KVCache):
    attention_backend = "spin"

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        segment_pages: int,
        num_host_segments: int,
        num_buffer_slots: int,
        buffer_pages_per_head: int,
        mandatory_pages_per_head: int,
        max_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_buckets: int = 64,
        elastic_shares: bool = True,
        reuse: bool = True,
        head_widths: list[list[int]] | None = None,
        head_mandatory: list[list[int]] | None = None,
    ) -> None:
        """head_widths, head_mandatory: per-head share widths of the GPU buffer (see
        ``GpuBuffer``); buffer_pages_per_head and mandatory_pages_per_head are then the
        widest head's."""
        device = torch.device(device)
        if buffer_pages_per_head < mandatory_pages_per_head:
            raise ValueError(
                f"cache.buffer_pages_per_head={buffer_pages_per_head} is below the pages a step "
                f"selects per head ({mandatory_pages_per_head}: sink + budget + local); raise it"
            )
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.mandatory_pages_per_head = mandatory_pages_per_head
        self.elastic_shares = elastic_shares
        self.host = HostTier(
            num_host_segments, segment_pages, page_size, head_dim, dtype, pin_memory=device.type == "cuda"
        )
        self.directory = SegmentDirectory(
            self.host, num_layers, num_kv_heads, page_size, -(-max_model_len // page_size), max_seqs, device
        )
        self.buffer = GpuBuffer(
            num_buffer_slots, page_size, head_dim, num_layers, num_kv_heads, max_seqs,
            buffer_pages_per_head, dtype, device, num_buckets, reuse, max_pages=-(-max_model_len // page_size),
            head_widths=head_widths, head_mandatory=head_mandatory,
        )

    # ---- capacity (token counts; "pages" are host pages) --------------------------------------

    def pages_for_tokens(self, num_tokens: int) -> int:
        E = self.host.segment_pages
        segs = -(-(-(-num_tokens // self.page_size)) // E)
        return segs * E * self.directory.segments_per_logical_segment

    @property
    def num_total_pages(self) -> int:
        return self.host.num_segments * self.host.segment_pages

    @property
    def num_free_pages(self) -> int:
        return self.host.num_free_segments * self.host.segment_pages

    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                     prefix: PrefixHit = NO_PREFIX) -> bool:
        """As ``KVCacheManager.can_allocate``; a newcomer also needs its buffer share, sized
        with ``num_queued`` requests waiting behind it (see ``GpuBuffer.share_for``). No
        prefix is ever cached here (``match_prefix`` never hits): ``prefix`` is empty."""
        if request_id not in self.directory:
            if not self.directory.has_free_row():
                return False
            if self.buffer.share_for(self.mandatory_pages_per_head, num_queued, self.elastic_shares) == 0:
                return False
        return self.host.can_allocate(self.directory.num_new_segments(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                 prefix: PrefixHit = NO_PREFIX) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len={self.max_model_len}")
        if request_id not in self.directory:
            buf, mandatory = self.buffer, self.mandatory_pages_per_head
            share = buf.share_for(mandatory, num_queued, self.elastic_shares)
            if self.elastic_shares:  # running shares give back their least recently used columns
                buf.make_room(buf.slots_for(share), buf.floor_share(mandatory, num_queued))
            row = self.directory.add(request_id)
            buf.attach(row, share)
        self.directory.grow(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        if request_id in self.directory:
            row = self.directory.row(request_id)
            self.buffer.detach(row)
            self.host.free(self.directory.remove(request_id))
            if self.elastic_shares:  # the others' buffering pages grow into the freed slots
                self.buffer.spread_free()

    def has(self, request_id: str) -> bool:
        return request_id in self.directory

    def request_ids(self) -> list[str]:
        return self.directory.request_ids()

    def row(self, request_id: str) -> int:
        return self.directory.row(request_id)

    # ---- stats --------------------------------------------------------------------------------

    def metadata_bytes(self) -> dict[str, int]:
        """Page-table bytes per tier (directory on the GPU, level-2 entries on the host), the
        buffer's own per-column bookkeeping, and a flat GPU table's bytes for comparison."""
        table = self.directory.metadata_bytes()
        b = self.buffer
        buffer_bytes = sum(t.numel() * t.element_size() for t in (b.res_slot, b.res_page, b.res_last_use))
        return {**table, "gpu_buffer": buffer_bytes}

    # ---- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        check_partition(self.directory.owned_segment_ids(), self.host.free_list, "host segments")
        rows = set()
        for rid in self.directory.request_ids():
            row = self.directory.row(rid)
            rows.add(row)
            groups = self.directory.host_mirror(rid)
            dev = self.directory.directory[row, :, :, : len(groups)].permute(2, 0, 1).reshape(len(groups), -1)
            if dev.cpu().tolist() != groups:
                raise AssertionError(f"directory row of {rid!r} disagrees with the host mirror")
            if (self.directory.directory[row, :, :, len(groups) :] != -1).any():
                raise AssertionError(f"directory row of {rid!r} has entries past its segments")
        self.buffer.check_integrity(rows)
