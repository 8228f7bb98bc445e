"""The GPU buffer: page slots caching host pages, split per request into mandatory and
buffering pages, evicted by the bucketed LRU.

Each running request gets a *share* of C_r slots per (layer, KV head) when it is admitted.
The share's bookkeeping lives on the GPU, sized by the buffer, not by the context::

    res_slot[row, l, h, c]      slot id of column c of that head's share (-1 past C_r)
    res_page[row, l, h, c]      logical page held there (-1 empty)
    res_last_use[row, l, h, c]  step of its last use (for the LRU)

Per decode step and layer, ``lookup`` takes the selected logical pages of each head (the
*mandatory* pages of the step) and resolves each to a slot: a hit keeps its column; a miss
takes a column chosen by the bucketed LRU among the columns not selected this step (the
*buffering* pages), and is listed for Retrieve (host page -> slot). A share of C_r >= K
columns always has room: at most K - hits misses, and C_r - hits unselected columns.
Everything is fixed-shape tensor work: no host sync, no sort. On CUDA it is one Triton launch
per layer (``kernels/buffer_lookup.py``: a program per request and head, hits found through
the share's page -> column map) instead of about 60 torch operators.

Elastic shares: the scheduler asks ``share_for`` at admission. A request gets
``min(buffer_pages, max(mandatory, free / (1 + waiting)))`` columns per head: alone it
keeps up to ``buffer_pages`` pages per head for temporal locality (high hit ratio); under
load each newcomer takes an equal part of what is free, down to its mandatory pages, so
more requests run at once at a lower hit ratio. Below the mandatory pages it waits.

Per-head widths (``head_widths``): with S-HPLB's per-head budgets, one width for every head
is the widest head's (537 pages at 128K for a 17K-token head, against 67 for the mean one),
so most of a share holds pages no step selects. Given each head's full width and its
mandatory pages, a share of ``c`` columns (counted at the widest head) gives head (l, h)
``ceil(c * full[l, h] / max_share)`` columns, at least its mandatory ones; columns past a
head's width have no slot (-1), and the lookup never evicts into them. A request then takes
the sum of its heads' widths in slots instead of ``c`` times the number of heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spin_cluster.kernels.buffer_lookup import buffer_lookup, buffer_lookup_ref, page_columns
from spin_cluster.kvcache.free_list import FreeList, check_partition
from spin_cluster.kvcache.lru import DEFAULT_NUM_BUCKETS

_NEVER = -(2**30)  # last_use of an empty column: older than any real step


@dataclass(frozen=True)
class Lookup:
    slots: torch.Tensor  # [B, Hkv, K] int32 slot of each selected page (0 where invalid)
    miss_dst: torch.Tensor  # [B*Hkv*K] int64 slot to fill, -1 where no miss


class GpuBuffer:
    def __init__(
        self,
        num_slots: int,
        page_size: int,
        head_dim: int,
        num_layers: int,
        num_kv_heads: int,
        max_seqs: int,
        max_share: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_buckets: int = DEFAULT_NUM_BUCKETS,
        reuse: bool = True,
        max_pages: int = 0,
        head_widths: list[list[int]] | None = None,
        head_mandatory: list[list[int]] | None = None,
    ) -> None:
        """head_widths: [L][Hkv] full share width of each head (the widest == ``max_share``),
        with head_mandatory [L][Hkv] the pages each selects per step; None: one width."""
        self.num_layers = num_layers
        # False: lookups forget what a share holds, so every selected page is a miss.
        self.reuse = reuse
        self.num_kv_heads = num_kv_heads
        self.max_share = max_share
        self.num_buckets = num_buckets
        # [N_slots, S, D] each
        self.k_slots = torch.zeros(num_slots, page_size, head_dim, dtype=dtype, device=device)
        self.v_slots = torch.zeros(num_slots, page_size, head_dim, dtype=dtype, device=device)
        shape = (max_seqs, num_layers, num_kv_heads, max_share)
        self.res_slot = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.res_page = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.res_last_use = torch.full(shape, _NEVER, dtype=torch.int32, device=device)
        # On CUDA, each share's page -> column map (logical page -> column holding it, -1), kept
        # in step with res_page by the lookup kernel: hits are found in O(1) per selected page
        # instead of comparing the selection with the whole share (max_pages: pages per request).
        self.res_col = None
        if torch.device(device).type == "cuda":
            if max_pages < 1:
                raise ValueError("a GPU buffer on CUDA needs max_pages (pages per request) for its page map")
            self.res_col = torch.full((max_seqs, num_layers, num_kv_heads, max_pages), -1, dtype=torch.int16, device=device)
        self._full, self._min = _head_widths(head_widths, head_mandatory, num_layers, num_kv_heads, max_share)
        self._free_slots = FreeList(num_slots)
        self._row_slots: dict[int, list[int]] = {}
        self._row_share: dict[int, int] = {}
        # Device counters, read once per step: lookups, hits, misses, evictions (a miss that
        # replaced a cached page rather than filling an empty column).
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)

    @property
    def page_bytes(self) -> int:
        """K and V bytes of one slot."""
        return 2 * self.k_slots[0].numel() * self.k_slots.element_size()

    @property
    def num_slots(self) -> int:
        return self.k_slots.shape[0]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def slots_per_column(self) -> int:
        """Slots one column of share takes across all layers and heads."""
        return self.num_layers * self.num_kv_heads

    @property
    def per_head_widths(self) -> bool:
        return self._full is not None

    def widths(self, share: int) -> torch.Tensor:
        """[L, Hkv] int64 columns of each head in a share of ``share`` columns."""
        if self._full is None:
            return torch.full((self.num_layers, self.num_kv_heads), share, dtype=torch.int64)
        scaled = (share * self._full + self.max_share - 1) // self.max_share
        return torch.minimum(torch.maximum(scaled, self._min), self._full)

    def slots_for(self, share: int) -> int:
        """Slots a share of ``share`` columns takes."""
        if self._full is None:
            return share * self.slots_per_column()
        return int(self.widths(share).sum())

    def share_for(self, mandatory: int, num_waiting: int, elastic: bool = True) -> int:
        """Columns per head (at the widest head) for a newcomer; 0 if they don't fit (it waits)."""
        free = self.num_free_slots
        if not elastic:
            return self.max_share if self.slots_for(self.max_share) <= free else 0
        # The widest share within an equal part of the free slots, and at least the mandatory one.
        target = free // (1 + num_waiting)
        lo, hi = mandatory, self.max_share
        while lo < hi:  # slots_for grows with the share: the largest share within the target
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.slots_for(mid) <= target else (lo, mid - 1)
        share = min(self.max_share, lo)
        return share if self.slots_for(share) <= free else 0

    def attach(self, row: int, share: int) -> None:
        n = self.slots_for(share) if 1 <= share <= self.max_share else 0
        if n == 0 or n > len(self._free_slots):
            raise RuntimeError(f"cannot give a share of {share} columns ({self.num_free_slots} slots free)")
        ids = self._free_slots.take(n)
        self._row_slots[row] = ids
        self._row_share[row] = share
        held = torch.arange(self.max_share) < self.widths(share)[..., None]  # [L, Hkv, C]: each head's first columns
        block = torch.full(held.shape, -1, dtype=torch.int32)
        block[held] = torch.tensor(ids, dtype=torch.int32)  # in order: layer, head, column
        self.res_slot[row] = block.to(self.res_slot.device)
        self.res_page[row] = -1
        self.res_last_use[row] = _NEVER
        if self.res_col is not None:
            self.res_col[row] = -1

    def detach(self, row: int) -> None:
        self._free_slots.give(self._row_slots.pop(row, []))
        self._row_share.pop(row, None)
        self.res_slot[row] = -1
        self.res_page[row] = -1
        self.res_last_use[row] = _NEVER
        if self.res_col is not None:
            self.res_col[row] = -1

    def share_of(self, row: int) -> int:
        return self._row_share.get(row, 0)

    def lookup(self, rows: torch.Tensor, layer: int, want: torch.Tensor, now: int | torch.Tensor) -> tuple[Lookup, torch.Tensor]:
        """Resolve selected pages to slots and update the shares.

        rows: [B] int64 rows; want: [B, Hkv, K] int logical pages, -1 padding (all valid
        entries of a head distinct). Returns the Lookup and the [B, Hkv, K] miss mask.
        One Triton launch on CUDA (``kernels.buffer_lookup``), else the same steps as
        fixed-shape torch ops.
        """
        fn = buffer_lookup if want.device.type == "cuda" else buffer_lookup_ref
        slots, miss_dst, miss = fn(self.res_page, self.res_slot, self.res_last_use, rows, layer, want, now,
                                   self.counters, num_buckets=self.num_buckets, reuse=self.reuse, res_col=self.res_col)
        # The caller pairs miss_dst with the host pages (it knows the directory).
        return Lookup(slots=slots, miss_dst=miss_dst), miss

    def resident(self, rows: torch.Tensor, layer: int, num_pages: int) -> torch.Tensor:
        """[B, Hkv, num_pages] bool: which of pages 0 .. num_pages - 1 each head's share of
        ``rows`` [B] holds now (Select's hysteresis). Fixed-shape, no host sync."""
        if self.res_col is not None and self.reuse:
            return self.res_col[rows, layer, :, :num_pages] >= 0
        pages = self.res_page[rows, layer].long()  # [B, Hkv, share]
        pages = torch.where((pages >= 0) & (pages < num_pages), pages, num_pages)
        held = torch.zeros(*pages.shape[:2], num_pages + 1, dtype=torch.bool, device=pages.device)
        return held.scatter_(-1, pages, True)[..., :num_pages]

    # ---- integrity --------------------------------------------------------------------------

    def check_integrity(self, live_rows: set[int]) -> None:
        check_partition([s for ids in self._row_slots.values() for s in ids], self._free_slots, "buffer slots")
        if set(self._row_slots) - live_rows:
            raise AssertionError(f"buffer shares held by rows without a request: {sorted(set(self._row_slots) - live_rows)}")
        for row, ids in self._row_slots.items():
            slots = self.res_slot[row].cpu()
            has_slot = slots >= 0
            if not torch.equal(has_slot, torch.arange(self.max_share) < self.widths(self._row_share[row])[..., None]):
                raise AssertionError(f"buffer share of row {row} does not have its heads' widths")
            if sorted(slots[has_slot].tolist()) != sorted(ids):
                raise AssertionError(f"buffer share of row {row} disagrees with its slot list")
            if self.res_col is not None and self.reuse:
                if not torch.equal(self.res_col[row], page_columns(self.res_page[row], self.res_col.shape[-1])):
                    raise AssertionError(f"the page -> column map of row {row} disagrees with its share")
            pages = self.res_page[row].cpu()
            for l in range(self.num_layers):
                for h in range(self.num_kv_heads):
                    held = [p for p in pages[l, h].tolist() if p >= 0]
                    if len(held) != len(set(held)):
                        raise AssertionError(f"row {row} layer {l} head {h} caches a page twice")


def _head_widths(widths, mandatory, num_layers: int, num_kv_heads: int, max_share: int):
    """Checked [L, Hkv] int64 tensors of full widths and mandatory pages, or (None, None)."""
    if widths is None and mandatory is None:
        return None, None
    if widths is None or mandatory is None:
        raise ValueError("head_widths and head_mandatory go together")
    full, least = torch.tensor(widths, dtype=torch.int64), torch.tensor(mandatory, dtype=torch.int64)
    shape = (num_layers, num_kv_heads)
    if tuple(full.shape) != shape or tuple(least.shape) != shape:
        raise ValueError(f"head_widths and head_mandatory must be [{num_layers}][{num_kv_heads}] (layers x KV heads)")
    if int(full.max()) != max_share or bool((least < 1).any()) or bool((full < least).any()):
        raise ValueError(f"head widths must be >= each head's mandatory pages (>= 1), the widest {max_share}")
    return full, least
