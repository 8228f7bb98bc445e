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

Elastic shares (the Spin paper's mandatory + buffering pages): a share is not fixed at
admission. Its columns past the mandatory ones (the pages a step selects) are buffering
pages, and they grow into whatever slots are free and are taken back, least recently used
first, when another request needs room:

    admission  a newcomer gets ``share_for``: an equal part of all slots among the running
               requests, itself and the queue behind it (``fair``), at least its mandatory
               pages, at most ``max_share``; running shares wider than that part give back
               their least recently used columns (``make_room``) until it fits. If even the
               mandatory pages do not fit, it waits.
    release    when a request leaves, the running shares grow into the freed slots, up to
               an equal part each (``spread_free``).

With ``max_share`` at a request's whole page count (``cache.buffer_share: 0``) a buffer with
room for every page keeps every page once touched (prefill installs its pages too, see
``SpinAttention``), and under pressure the shares shrink to what the batch leaves them.

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

from spin_cluster.kernels.buffer_lookup import (
    HomeMap,
    buffer_lookup,
    page_columns,
    resident_pages,
    resolve_selected,
    with_gpu_homes,
)
from spin_cluster.kvcache.free_list import FreeList, check_partition

# Recency buckets of the LRU eviction (``kernels/bucketed_lru.py``): ages past the last bucket
# are all equally old.
DEFAULT_NUM_BUCKETS = 64

_NEVER = -(2**30)  # last_use of an empty column: older than any real step


@dataclass(frozen=True)
class Lookup:
    slots: torch.Tensor  # [B, Hkv, K] int32 slot of each selected page (0 where invalid)
    miss_dst: torch.Tensor  # [B*Hkv*K] int64 slot to fill, -1 where no miss


@dataclass(frozen=True)
class InstallPlan:
    """A prefill chunk's pages to keep in the buffer (``GpuBuffer.install_plan``), per layer."""

    row_id: int  # the request's row
    row: torch.Tensor  # [1] int64 the same, on the device (the lookup's rows)
    want: torch.Tensor  # [L, 1, Hkv, Kc] pages starting in the chunk, -1 where a head has no room
    straddle: int  # the page begun in an earlier chunk (forgotten), -1: none
    page_index: torch.Tensor  # [n] each token's page minus the first page starting in the chunk
    offset: torch.Tensor  # [n] each token's offset in its page


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
        num_home_pages: int = 0,
        padding_row: int | None = None,
    ) -> None:
        """head_widths: [L][Hkv] full share width of each head (the widest == ``max_share``),
        with head_mandatory [L][Hkv] the pages each selects per step; None: one width.
        num_home_pages: GPU pages that are pages' homes (``homes.py``), kept in the same page
        array after the buffer's slots, so that attention reads a home page and a cached host
        page through one slot index. padding_row: a row (< max_seqs) whose share is one
        column per head on slots of its own, after the home pages, for the padding entries
        of a decode batch (``OffloadedKVManager.padding_row``); None: no such row."""
        self.num_layers = num_layers
        # False: lookups forget what a share holds, so every selected page is a miss.
        self.reuse = reuse
        self.num_kv_heads = num_kv_heads
        self.max_share = max_share
        self.num_buckets = num_buckets
        # [N_slots + N_home, S, D] each: the buffer's slots, then the GPU home pages
        self._num_slots = num_slots
        num_pad = 0 if padding_row is None else num_layers * num_kv_heads
        total = num_slots + num_home_pages + num_pad
        self.k_slots = torch.zeros(total, page_size, head_dim, dtype=dtype, device=device)
        self.v_slots = torch.zeros(total, page_size, head_dim, dtype=dtype, device=device)
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
        self._row_slots: dict[int, set[int]] = {}  # each share's slots
        self._row_share: dict[int, int] = {}
        # Device counters, read once per step: lookups, hits, misses, evictions (a miss that
        # replaced a cached page rather than filling an empty column).
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        self.padding_row = padding_row
        if padding_row is not None:
            if not 0 <= padding_row < max_seqs:
                raise ValueError(f"padding_row={padding_row} is not a row of {max_seqs}")
            self._pad_slots = torch.arange(num_slots + num_home_pages, total, dtype=torch.int32)
            self.res_slot[padding_row, :, :, 0] = self._pad_slots.view(num_layers, num_kv_heads).to(self.res_slot.device)

    @property
    def page_bytes(self) -> int:
        """K and V bytes of one slot."""
        return 2 * self.k_slots[0].numel() * self.k_slots.element_size()

    @property
    def num_slots(self) -> int:
        """The buffer's slots (the GPU home pages after them are not the buffer's)."""
        return self._num_slots

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
        """Columns per head (at the widest head) for a newcomer; 0 if they don't fit (it waits).
        Elastic: counts the columns running shares would give back (``make_room``)."""
        free = self.num_free_slots
        if not elastic:
            return self.max_share if self.slots_for(self.max_share) <= free else 0
        floor = self.floor_share(mandatory, num_waiting)
        room = free + self._reclaimable(floor)
        share = self._widest_within(room, mandatory, floor)
        return share if share and self.slots_for(share) <= room else 0

    def floor_share(self, mandatory: int, num_waiting: int) -> int:
        """The share a newcomer aims at and running shares keep when it is admitted: an equal
        part of every slot among the running requests, it and ``num_waiting`` more, at least
        ``mandatory``, at most ``max_share``."""
        part = self.num_slots // (len(self._row_share) + 1 + num_waiting)
        return max(mandatory, self._widest_within(part, 1, self.max_share) or 1)

    def _widest_within(self, num_slots: int, lo: int, hi: int) -> int:
        """The largest share in [lo, hi] whose slots fit ``num_slots``; 0 if lo does not."""
        if self.slots_for(lo) > num_slots:
            return 0
        while lo < hi:  # slots_for grows with the share
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.slots_for(mid) <= num_slots else (lo, mid - 1)
        return lo

    def _reclaimable(self, floor: int) -> int:
        """Slots running shares wider than ``floor`` would give back, shrunk to it."""
        keep = self.slots_for(floor)
        return sum(max(0, len(ids) - keep) for ids in self._row_slots.values())

    def make_room(self, num_slots: int, floor: int) -> None:
        """Shrink running shares, widest first, towards ``floor`` columns (their least
        recently used columns first, see ``shrink``) until ``num_slots`` are free."""
        # A share of s columns holds slots_for(s) slots, so the targets are the host's to
        # choose; the shares then shrink together (``_shrink_rows``: one read of the dropped
        # slots, not one host sync a share).
        targets, free = {}, self.num_free_slots
        for row in sorted(self._row_share, key=lambda r: (-self._row_share[r], r)):
            if free >= num_slots:
                break
            share = self._row_share[row]
            if share <= floor:
                continue
            # The widest share, not below the floor, that frees enough (or the floor).
            held = len(self._row_slots[row])
            target = self._widest_within(held - (num_slots - free), floor, share) or floor
            targets[row] = target
            free += held - self.slots_for(target)
        self._shrink_rows(targets)

    def spread_free(self) -> None:
        """Grow running shares into the free slots, up to an equal part of every slot each
        (lower rows first when the free slots do not reach every share)."""
        if not self._row_share:
            return
        part = self._widest_within(self.num_slots // len(self._row_share), 1, self.max_share)
        for row in sorted(self._row_share):
            share = self._row_share[row]
            if part <= share:
                continue
            room = self.num_free_slots + len(self._row_slots[row])
            target = self._widest_within(room, share, part)
            if target > share:
                self.grow(row, target)

    def shrink(self, row: int, share: int) -> None:
        """Narrow the share of ``row`` to ``share`` columns: per (layer, head) the columns
        kept are the most recently used (empty columns count as oldest; ties: lower column
        first), moved to the front; the others' slots are freed and their pages forgotten."""
        self._shrink_rows({row: share})

    def _shrink_rows(self, targets: dict[int, int]) -> None:
        """``shrink`` of several rows at once ({row: share}): the same columns kept and the
        same slots freed, in the rows' order, with one read of the dropped slots."""
        if not targets:
            return
        for row, share in targets.items():
            old = self._row_share[row]
            if not 1 <= share <= old:
                raise ValueError(f"cannot shrink a share of {old} columns to {share}")
        dev = self.res_slot.device
        rows = torch.tensor(list(targets), device=dev)
        slot, page, last = self.res_slot[rows], self.res_page[rows], self.res_last_use[rows]  # [R, L, Hkv, C]
        key = torch.where(slot >= 0, last, torch.iinfo(torch.int32).min)
        order = key.argsort(dim=-1, descending=True, stable=True)
        slot, page, last = (t.gather(-1, order) for t in (slot, page, last))
        cols = torch.arange(self.max_share, device=dev)
        widths = torch.stack([self.widths(share) for share in targets.values()]).to(dev)  # [R, L, Hkv]
        keep = cols < widths[..., None]  # [R, L, Hkv, C]
        drop = ~keep & (slot >= 0)
        counts = drop.flatten(1).sum(1)
        self.res_slot[rows] = slot.masked_fill(~keep, -1)
        self.res_page[rows] = page.masked_fill(~keep, -1)
        self.res_last_use[rows] = last.masked_fill(~keep, _NEVER)
        if self.res_col is not None:
            self.res_col[rows] = page_columns(self.res_page[rows], self.res_col.shape[-1])
        values = torch.cat([counts.to(slot.dtype), slot[drop]]).tolist()  # one host read
        at = len(targets)
        for (row, share), n in zip(targets.items(), values[:at]):
            dropped = values[at : at + n]
            at += n
            self._row_slots[row].difference_update(dropped)
            self._free_slots.give(dropped)
            self._row_share[row] = share

    def grow(self, row: int, share: int) -> None:
        """Widen the share of ``row`` to ``share`` columns: the new columns (past each head's
        old width) take free slots and hold nothing yet."""
        old = self._row_share[row]
        if not old <= share <= self.max_share:
            raise ValueError(f"cannot grow a share of {old} columns to {share} (max {self.max_share})")
        at = self._new_columns(old, share)
        n = at.numel()
        if n > self.num_free_slots:
            raise RuntimeError(f"cannot grow a share by {n} slots ({self.num_free_slots} free)")
        ids = self._free_slots.take(n)
        # One indexed write on the device, queued behind the step in flight: no copy of the
        # share's block to the host and back, which waited for that step each time a request
        # left and every other share grew.
        dev = self.res_slot.device
        self.res_slot[row].view(-1)[at.to(dev, non_blocking=True)] = torch.tensor(ids, dtype=torch.int32).to(
            dev, non_blocking=True)
        self._row_slots[row].update(ids)
        self._row_share[row] = share

    def _new_columns(self, old: int, share: int) -> torch.Tensor:
        """[n] int64 flat positions in a row's [L, Hkv, C] block of the columns a share of
        ``share`` has and one of ``old`` has not, in (layer, head, column) order."""
        lo, hi = self.widths(old).flatten(), self.widths(share).flatten()  # [L * Hkv]
        counts = hi - lo
        start = torch.arange(lo.numel()) * self.max_share + lo  # each head's first new column
        offset = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        return torch.repeat_interleave(start, counts) + offset

    def attach(self, row: int, share: int) -> None:
        n = self.slots_for(share) if 1 <= share <= self.max_share else 0
        if n == 0 or n > len(self._free_slots):
            raise RuntimeError(f"cannot give a share of {share} columns ({self.num_free_slots} slots free)")
        ids = self._free_slots.take(n)
        self._row_slots[row] = set(ids)
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
        self._free_slots.give(sorted(self._row_slots.pop(row, ())))  # lowest ids taken first
        self._row_share.pop(row, None)
        self.res_slot[row] = -1
        self.res_page[row] = -1
        self.res_last_use[row] = _NEVER
        if self.res_col is not None:
            self.res_col[row] = -1

    def share_of(self, row: int) -> int:
        return self._row_share.get(row, 0)

    def lookup(self, rows: torch.Tensor, layer: int, want: torch.Tensor, now: int | torch.Tensor,
               count: bool = True) -> tuple[Lookup, torch.Tensor]:
        """Resolve selected pages to slots and update the shares.

        rows: [B] int64 rows; want: [B, Hkv, K] int logical pages, -1 padding (all valid
        entries of a head distinct, at most the head's width). Returns the Lookup and the
        [B, Hkv, K] miss mask. One Triton launch on CUDA (``kernels.buffer_lookup``), else the
        same steps as fixed-shape torch ops. ``count``: add to the hit/miss counters (False
        for pages prefill installs, which no step selected).
        """
        counters = self.counters if count else torch.zeros_like(self.counters)
        slots, miss_dst, miss = buffer_lookup(self.res_page, self.res_slot, self.res_last_use, rows, layer, want, now,
                                              counters, num_buckets=self.num_buckets, reuse=self.reuse,
                                              res_col=self.res_col, uncounted_row=self._uncounted)
        # The caller pairs miss_dst with the host pages (it knows the directory).
        return Lookup(slots=slots, miss_dst=miss_dst), miss

    def resolve(self, rows: torch.Tensor, layer: int, want: torch.Tensor, num_selected: torch.Tensor,
                tail_len: torch.Tensor, now: torch.Tensor, homes: HomeMap) -> tuple[torch.Tensor, ...]:
        """A decode layer's selected pages -> slots in one launch on CUDA (``kernels.buffer_lookup``'s
        ``resolve_selected``): pages at home on the GPU are read in place, host pages looked up
        as ``lookup`` does. Returns (slots, miss_dst, src, lens, tail_slot) as documented there."""
        return resolve_selected(self.res_page, self.res_slot, self.res_last_use, rows, layer, want, num_selected,
                                tail_len, now, self.counters, homes, num_buckets=self.num_buckets, reuse=self.reuse,
                                res_col=self.res_col, uncounted_row=self._uncounted)

    @property
    def _uncounted(self) -> int:
        """The row whose lookups the counters leave out (the padding row's), -1: none."""
        return -1 if self.padding_row is None else self.padding_row

    def install_plan(self, row: int, first_token: int, num_tokens: int, page_size: int) -> "InstallPlan | None":
        """Which pages of a prefill chunk (tokens first_token .. +num_tokens of ``row``) to keep
        in the buffer: the pages that start inside the chunk, the newest ones first, as many
        per head as its share's width::

            tokens       |   earlier chunk   |         this chunk          |
            pages        | .. | straddle |  p_lo  ..  (older, dropped) .. newest (kept) |

        A page that began in an earlier chunk (``straddle``) is forgotten rather than
        completed: its slot may lack this chunk's tokens, and a later miss reads it whole
        from the host tier. None when nothing is kept (no reuse, or no share)."""
        share = self._row_share.get(row, 0)
        if not self.reuse or not share:
            return None
        S = page_size
        end = first_token + num_tokens
        p_lo, p_hi = -(-first_token // S), -(-end // S)  # pages starting in the chunk: [p_lo, p_hi)
        straddle = first_token // S if first_token % S else -1
        if p_hi <= p_lo and straddle < 0:
            return None
        dev = self.res_page.device
        widths = self.widths(share).to(dev)  # [L, Hkv]
        pages = torch.arange(p_lo, max(p_hi, p_lo), device=dev)  # [Kc]
        keep = pages >= p_hi - widths[..., None]  # [L, Hkv, Kc]: each head's newest pages
        want = torch.where(keep, pages, -1).unsqueeze(1)  # [L, 1, Hkv, Kc]
        pos = torch.arange(first_token, end, device=dev)  # [n]
        return InstallPlan(row_id=row, row=torch.tensor([row], device=dev), want=want, straddle=straddle,
                           page_index=(pos // S - p_lo), offset=pos % S)

    def install(self, plan: "InstallPlan", layer: int, now: int | torch.Tensor) -> torch.Tensor:
        """Give the plan's pages of one layer columns of the share (as misses would get them,
        least recently used columns first, uncounted) and forget its straddling page.
        Returns [n * Hkv] flat slot indices (slot * S + offset, -1: not kept) for the chunk's
        tokens in (token, head) order, for ``write_tokens``."""
        row = plan.row_id
        if plan.straddle >= 0:
            held = self.res_page[row, layer] == plan.straddle  # [Hkv, C]
            self.res_page[row, layer].masked_fill_(held, -1)
            self.res_last_use[row, layer].masked_fill_(held, _NEVER)
            if self.res_col is not None:
                self.res_col[row, layer, :, plan.straddle] = -1
        want = plan.want[layer]  # [1, Hkv, Kc]
        n = plan.page_index.shape[0]
        if want.shape[-1] == 0:
            return torch.full((n * self.num_kv_heads,), -1, dtype=torch.int64, device=want.device)
        lookup, _ = self.lookup(plan.row, layer, want, now, count=False)
        idx = plan.page_index.clamp(min=0)  # [n] (tokens of the straddling page: index < 0)
        slot = lookup.slots[0][:, idx].T.long()  # [n, Hkv]
        kept = (want[0][:, idx].T >= 0) & (plan.page_index >= 0)[:, None]
        S = self.k_slots.shape[1]
        return torch.where(kept, slot * S + plan.offset[:, None], -1).flatten()

    def resident(self, rows: torch.Tensor, layer: int, num_pages: int, homes: HomeMap | None = None) -> torch.Tensor:
        """[B, Hkv, num_pages] bool: which of pages 0 .. num_pages - 1 each head's share of
        ``rows`` [B] holds now or, with ``homes`` (GPU homes), lives at home on the GPU: the
        pages a step reads without a transfer (Select's hysteresis). Fixed-shape, no host sync;
        one launch on CUDA (``kernels.buffer_lookup.resident_pages``)."""
        if self.res_col is not None and self.reuse:
            return resident_pages(self.res_col, rows, layer, num_pages, homes)
        pages = self.res_page[rows, layer].long()  # [B, Hkv, share]
        pages = torch.where((pages >= 0) & (pages < num_pages), pages, num_pages)
        held = torch.zeros(*pages.shape[:2], num_pages + 1, dtype=torch.bool, device=pages.device)
        return with_gpu_homes(held.scatter_(-1, pages, True)[..., :num_pages], rows, layer, homes)

    # ---- integrity --------------------------------------------------------------------------

    def check_integrity(self, live_rows: set[int]) -> None:
        check_partition([s for ids in self._row_slots.values() for s in ids], self._free_slots, "buffer slots")
        if self.padding_row is not None:
            slots = self.res_slot[self.padding_row].cpu()
            if not torch.equal(slots[..., 0].flatten(), self._pad_slots) or bool((slots[..., 1:] != -1).any()):
                raise AssertionError("the padding row's share is not its own one column per head")
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
