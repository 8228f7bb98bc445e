"""The offloaded KV cache (Spin): pages at home on the GPU or the host, a GPU buffer in front.

Same request-level API as ``KVCacheManager`` (the scheduler cannot tell them apart):
``can_allocate`` / ``allocate`` / ``free`` in token counts, ``check_integrity``. On top,
admission gives each request its buffer share (``buffer.py``), and the attention backend
reads the directory and the buffer once per step and layer.

Capacity is the GPU's home pages plus the host tier (``homes.py``): a page is born on the
GPU while there is room; when the GPU is full, the coldest GPU segments (no recent step
selected them) move to the host to make room (``spill``), and a host page that Select picks
is retrieved into a buffer slot. A request is admitted when its segments fit in both tiers
together and its mandatory buffer share fits; otherwise it waits in the queue. A running
request that cannot grow preempts the newest one (the scheduler's rule), so full tiers never
corrupt a running request. With no GPU home pages (``num_gpu_segments=0``) the host is every
page's home, as in the Spin paper.
"""

from __future__ import annotations

import dataclasses

import torch

from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit
from spin_cluster.kvcache.buffer import DEFAULT_NUM_BUCKETS, GpuBuffer, InstallPlan
from spin_cluster.kvcache.directory import SegmentDirectory
from spin_cluster.kvcache.homes import PageHomes
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
        num_buckets: int = DEFAULT_NUM_BUCKETS,
        elastic_shares: bool = True,
        reuse: bool = True,
        head_widths: list[list[int]] | None = None,
        head_mandatory: list[list[int]] | None = None,
        num_gpu_segments: int = 0,
        host_dtype: torch.dtype | None = None,
    ) -> None:
        """head_widths, head_mandatory: per-head share widths of the GPU buffer (see
        ``GpuBuffer``); buffer_pages_per_head and mandatory_pages_per_head are then the
        widest head's. num_gpu_segments: GPU home segments of segment_pages pages each, in the
        buffer's page array after its slots (0: the host is every page's home). host_dtype: the
        host pages' dtype (float8_e4m3fn: FP8 with per-row scales); None: ``dtype``."""
        device = torch.device(device)
        if buffer_pages_per_head < mandatory_pages_per_head:
            raise ValueError(
                f"a GPU buffer share of {buffer_pages_per_head} pages per head (BufferPolicy.pages_per_head) is below "
                f"the pages a step selects per head ({mandatory_pages_per_head}: sink + budget + local); raise it"
            )
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.mandatory_pages_per_head = mandatory_pages_per_head
        self.elastic_shares = elastic_shares
        self.host = HostTier(
            num_host_segments, segment_pages, page_size, head_dim, host_dtype or dtype, pin_memory=device.type == "cuda",
            allow_empty=num_gpu_segments > 0,
        )
        self.homes = PageHomes(self.host, num_gpu_segments, num_buffer_slots, device)
        # One row past the requests' is the padding row's (``padding_row``).
        self.directory = SegmentDirectory(
            self.homes, num_layers, num_kv_heads, page_size, -(-max_model_len // page_size), max_seqs, device,
            reserved_rows=1,
        )
        self.buffer = GpuBuffer(
            num_buffer_slots, page_size, head_dim, num_layers, num_kv_heads, max_seqs + 1,
            buffer_pages_per_head, dtype, device, num_buckets, reuse, max_pages=-(-max_model_len // page_size),
            head_widths=head_widths, head_mandatory=head_mandatory, num_home_pages=num_gpu_segments * segment_pages,
            padding_row=max_seqs,
        )
        # Segments moved GPU -> host since start (``spill``).
        self.num_spilled_segments = 0

    # ---- capacity (token counts; "pages" are home pages of both tiers) ------------------------

    def pages_for_tokens(self, num_tokens: int) -> int:
        E = self.host.segment_pages
        segs = -(-(-(-num_tokens // self.page_size)) // E)
        return segs * E * self.directory.segments_per_logical_segment

    @property
    def num_total_pages(self) -> int:
        return self.homes.num_segments * self.host.segment_pages

    @property
    def num_free_pages(self) -> int:
        return self.homes.num_free_segments * self.host.segment_pages

    def reset_counters(self) -> None:
        super().reset_counters()
        self.num_spilled_segments = 0

    def tier_pages(self) -> dict[str, tuple[int, int]]:
        """(used, total) home pages per tier: ``{"gpu": .., "host": ..}``."""
        E, h = self.host.segment_pages, self.homes
        return {
            "gpu": ((h.num_gpu_segments - len(h.gpu_free)) * E, h.num_gpu_segments * E),
            "host": ((self.host.num_segments - self.host.num_free_segments) * E, self.host.num_segments * E),
        }

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
        return self.homes.can_allocate(self.directory.num_new_segments(request_id, num_tokens))

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
        need = self.directory.num_new_segments(request_id, num_tokens)
        self.spill(min(need - len(self.homes.gpu_free), self.host.num_free_segments))
        self.homes.mark_used(self.directory.grow(request_id, num_tokens))

    def spill(self, num_segments: int) -> list[tuple[str, int, int, int, int]]:
        """Move the ``num_segments`` coldest GPU segments (at most what the host has free) to
        host segments: least recently selected first, ties by (row, layer, head, segment).
        Device work in stream order (the copies follow every step already issued) and one
        read of the chosen segments. Returns the moves: (request, layer, KV head, logical
        segment, new host segment)."""
        homes, d = self.homes, self.directory
        if num_segments <= 0 or not homes.num_gpu_segments:
            return []
        table = d.directory.flatten()  # [R * L * Hkv * n_seg]
        on_gpu = table >= homes.num_host_segments
        n = min(num_segments, int(on_gpu.sum()), self.host.num_free_segments)
        if n == 0:
            return []
        stamp = homes.gpu_last_use[(table - homes.num_host_segments).clamp(min=0).long()]
        key = torch.where(on_gpu, stamp.long(), torch.iinfo(torch.int64).max)
        chosen = torch.sort(key, stable=True).indices[:n]  # a stable sort: ties by flat position
        gpu_segs, flat_ids = table[chosen].tolist(), chosen.tolist()
        host_segs = self.host.allocate(n)
        _, L, H, N = d.directory.shape
        row_to_request = {d.row(r): r for r in d.request_ids()}
        moves = []
        for flat, seg in zip(flat_ids, host_segs):
            row, rest = divmod(flat, L * H * N)
            layer, rest = divmod(rest, H * N)
            head, logical = divmod(rest, N)
            moves.append((row_to_request[row], layer, head, logical, seg))
        self._copy_segments(gpu_segs, host_segs)
        d.rehome(moves)
        homes.free(gpu_segs)
        self.num_spilled_segments += n
        return moves

    # Pages per write launch of a spill: a long chunk's allocation may spill tens of millions
    # of token rows, and their K/V gathered at once would need as many GiB of GPU scratch on a
    # GPU that is full; 1/4 GiB of bf16 K (and as much V) at S=32, D=128.
    SPILL_PAGES_PER_WRITE = 32768

    def _copy_segments(self, gpu_segs: list[int], host_segs: list[int]) -> None:
        """K/V of GPU segments -> host segments, whole pages, a write launch per
        ``SPILL_PAGES_PER_WRITE`` pages."""
        E, S, buf = self.host.segment_pages, self.page_size, self.buffer
        dev = buf.k_slots.device
        i = torch.arange(E, device=dev)
        src = (torch.tensor(gpu_segs, device=dev)[:, None] * E + i).flatten()  # [n * E] page ids
        dst = (torch.tensor(host_segs, device=dev)[:, None] * E + i).flatten()
        D = buf.k_slots.shape[-1]
        tok = torch.arange(S, device=dev)
        for at in range(0, src.numel(), self.SPILL_PAGES_PER_WRITE):
            part = slice(at, at + self.SPILL_PAGES_PER_WRITE)
            slots = self.homes.gpu_slots(src[part])
            flat = (dst[part, None] * S + tok).flatten()  # host token slots
            k = buf.k_slots.index_select(0, slots).reshape(-1, D)
            v = buf.v_slots.index_select(0, slots).reshape(-1, D)
            self.host.write(k, v, flat)

    # ---- the padding row ----------------------------------------------------------------------

    # Its directory entry's name: no request id the engine gives (those are printable).
    _PADDING_ID = "\x00padding"

    def padding_row(self) -> int | None:
        """The row that pads a decode batch up to a captured CUDA graph's size
        (``SpinDecodeGraphs``), or None if the tiers have no segment for it.

        It is a one-token request that nobody runs: a padding entry decodes token 0 at
        position 0 of this row, so every op of the step (Offload, the Index, Select, Retrieve,
        attention) treats it as a real request and touches nothing but its own page, its Index
        entries and its own share: one column per head on slots of its own
        (``GpuBuffer(padding_row=)``), outside the elastic shares, whose lookups the hit and
        miss counters leave out. Many entries of one batch may pad with it: they compute the
        same K/V and write the same values. Its page is taken once, when first asked for (one
        segment of every layer and head), and kept; ``request_ids`` does not list it."""
        if self._PADDING_ID not in self.directory:
            if not self.homes.can_allocate(self.directory.num_new_segments(self._PADDING_ID, 1)):
                return None
            self.directory.add(self._PADDING_ID, row=self.buffer.padding_row)
            self.homes.mark_used(self.directory.grow(self._PADDING_ID, 1))
        return self.directory.row(self._PADDING_ID)

    def free(self, request_id: str) -> None:
        if request_id in self.directory:
            row = self.directory.row(request_id)
            self.buffer.detach(row)
            self.homes.free(self.directory.remove(request_id))
            if self.elastic_shares:  # the others' buffering pages grow into the freed slots
                self.buffer.spread_free()

    def has(self, request_id: str) -> bool:
        return request_id in self.directory

    def request_ids(self) -> list[str]:
        return [r for r in self.directory.request_ids() if r != self._PADDING_ID]

    def row(self, request_id: str) -> int:
        return self.directory.row(request_id)

    # ---- the GPU tier, as decode and prefill read it ----------------------------------------

    def install_plan(self, request_id: str, first_token: int, num_tokens: int) -> InstallPlan | None:
        """The buffer's plan for a prefill chunk's pages (``GpuBuffer.install_plan``) less
        the pages whose home is the GPU: those are read in place and need no copy."""
        row = self.directory.row(request_id)
        plan = self.buffer.install_plan(row, first_token, num_tokens, self.page_size)
        if plan is None or not self.homes.num_gpu_segments or plan.want.shape[-1] == 0:
            return plan
        want = plan.want  # [L, 1, Hkv, Kc]
        pages = want.clamp(min=0)
        at_home = self.homes.on_gpu(self.directory.directory[row], int(pages.max()) + 1)  # [L, Hkv, P]
        at_home = at_home.gather(-1, pages[:, 0])[:, None]  # [L, 1, Hkv, Kc]
        want = torch.where(at_home, -1, want)
        if not bool((want >= 0).any()):  # every page of the chunk is on the GPU: nothing to install
            return None if plan.straddle < 0 else dataclasses.replace(plan, want=want[..., :0])
        return dataclasses.replace(plan, want=want)

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
        self.homes.check(self.directory.owned_segment_ids())
        self.directory.check_logical()
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
