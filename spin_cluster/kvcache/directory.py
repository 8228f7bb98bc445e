"""Two-level page table for the offloaded cache.

Level 1, on the GPU, is a small directory: per (request row, layer, KV head), one entry per
*segment* of E logical pages, holding the segment id (or -1 before it exists); segment ids
name a host or a GPU segment (``homes.py``: host ids first, then GPU ids)::

    directory[row, layer, kv_head, p // E] = seg      (int32)

Level 2 is the segment itself, allocated on demand as the request grows: E consecutive
pages of one tier, so that the page id of logical page p is arithmetic and the second level
stores no entries at all::

    page(p) = directory[row, layer, kv_head, p // E] * E + p % E

Each logical segment of a request (its L * Hkv segments together) also gets a *logical
segment* id, for the sparse algorithm's per-page index (``SparseAlgorithm.bind_pages``)::

    logical_ids[row, p // E] = g       index page(p) = g * E + p % E

There are as many as the tiers hold logical segments (their segments / (L * Hkv)), so the
index is sized by what the cache holds, not by max_seqs x max_model_len: at 64 rows of 128K
tokens on GPU + host tiers that hold 2.3M tokens, a quarter of the bytes.

Which pages are *in the GPU buffer* is the buffer's business (``buffer.py``): its metadata
is sized by the buffer, not by the context. A flat table (one entry per logical page on the
GPU) needs E times the directory's bytes; ``metadata_bytes`` reports both.
"""

from __future__ import annotations

import torch

from spin_cluster.kvcache.free_list import FreeList, check_partition
from spin_cluster.kvcache.homes import PageHomes
from spin_cluster.kvcache.host_tier import HostTier

_ENTRY_BYTES = 4  # int32


class SegmentDirectory:
    def __init__(
        self,
        host: HostTier | PageHomes,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        max_pages_per_seq: int,
        max_seqs: int,
        device: torch.device | str,
        reserved_rows: int = 0,
    ) -> None:
        """host: where segments come from (``allocate`` / ``free``): the host tier alone, or
        both tiers (``PageHomes``). reserved_rows: rows after the ``max_seqs`` requests' that
        ``add`` gives only when asked for by number (the offloaded cache's padding row)."""
        self.host = host
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.segment_pages = host.segment_pages
        self.max_pages_per_seq = max_pages_per_seq
        self.max_segments_per_seq = -(-max_pages_per_seq // self.segment_pages)
        # [R, L, Hkv, n_seg] int32
        self.directory = torch.full(
            (max_seqs + reserved_rows, num_layers, num_kv_heads, self.max_segments_per_seq), -1, dtype=torch.int32, device=device
        )
        self._free_rows = FreeList(max_seqs)
        self._reserved_rows = set(range(max_seqs, max_seqs + reserved_rows))
        self._request_to_row: dict[str, int] = {}
        # Host mirror: request -> one list of L*Hkv segment ids per logical segment, [L, Hkv] order.
        self._request_to_segments: dict[str, list[list[int]]] = {}
        # [R, n_seg] int32 logical segment ids (-1: none yet), and their free list: never
        # empty while the tiers have segments for a logical segment.
        self.num_logical_segments = host.num_segments // self.segments_per_logical_segment
        self.logical_ids = torch.full((max_seqs + reserved_rows, self.max_segments_per_seq), -1, dtype=torch.int32, device=device)
        self._free_logical = FreeList(self.num_logical_segments)
        self._request_to_logical: dict[str, list[int]] = {}

    @property
    def segments_per_logical_segment(self) -> int:
        return self.num_layers * self.num_kv_heads

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._request_to_row

    def has_free_row(self) -> bool:
        return len(self._free_rows) > 0

    def row(self, request_id: str) -> int:
        return self._request_to_row[request_id]

    def request_ids(self) -> list[str]:
        return list(self._request_to_row)

    def add(self, request_id: str, row: int | None = None) -> int:
        """A row for the request: the lowest free one, or ``row``, a reserved row."""
        if request_id in self._request_to_row:
            raise KeyError(f"request {request_id!r} already has a directory row")
        if row is None:
            row = self._free_rows.take(1)[0]
        elif row in self._reserved_rows:
            self._reserved_rows.remove(row)
        else:
            raise ValueError(f"row {row} is not a free reserved row")
        self._request_to_row[request_id] = row
        self._request_to_segments[request_id] = []
        self._request_to_logical[request_id] = []
        return row

    def remove(self, request_id: str) -> list[int]:
        """Drop the request; return its segment ids for their tiers to free."""
        row = self._request_to_row.pop(request_id)
        if row < self._free_rows.total:
            self._free_rows.give([row])
        else:
            self._reserved_rows.add(row)
        self.directory[row] = -1
        self.logical_ids[row] = -1
        self._free_logical.give(self._request_to_logical.pop(request_id))
        segs = self._request_to_segments.pop(request_id)
        return [s for group in segs for s in group]

    def num_new_segments(self, request_id: str, num_tokens: int) -> int:
        have = len(self._request_to_segments[request_id]) if request_id in self else 0
        need = -(-(-(-num_tokens // self.page_size)) // self.segment_pages)
        return max(0, need - have) * self.segments_per_logical_segment

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate segments so that the request can hold ``num_tokens`` tokens; returns them."""
        n = self.num_new_segments(request_id, num_tokens)
        if not n:
            return []
        per = self.segments_per_logical_segment
        ids = self.host.allocate(n)
        groups = self._request_to_segments[request_id]
        start = len(groups)
        if start + n // per > self.max_segments_per_seq:
            self.host.free(ids)
            raise ValueError(f"request {request_id!r} would exceed max_model_len")
        groups.extend(ids[i * per : (i + 1) * per] for i in range(n // per))
        logical = self._free_logical.take(n // per)
        self._request_to_logical[request_id].extend(logical)
        row = self.row(request_id)
        # [n, L, Hkv] -> [L, Hkv, n]
        block = torch.tensor(ids, dtype=torch.int32).view(-1, self.num_layers, self.num_kv_heads)
        self.directory[row, :, :, start : start + block.shape[0]] = block.permute(1, 2, 0).to(self.directory.device)
        self.logical_ids[row, start : start + len(logical)] = torch.tensor(logical, dtype=torch.int32).to(
            self.logical_ids.device)
        return ids

    def rehome(self, moves: list[tuple[str, int, int, int, int]]) -> None:
        """Point segments at new homes: (request, layer, KV head, logical segment, new id)
        each, in the host mirror and (one indexed write) in the directory."""
        if not moves:
            return
        per = self.num_kv_heads
        for rid, layer, head, logical, seg in moves:
            self._request_to_segments[rid][logical][layer * per + head] = seg
        idx = torch.tensor([(self.row(r), l, h, s) for r, l, h, s, _ in moves], dtype=torch.long).T
        new = torch.tensor([m[4] for m in moves], dtype=torch.int32)
        dev = self.directory.device
        self.directory[tuple(i.to(dev) for i in idx)] = new.to(dev)

    # ---- lookups, on the directory's device, fixed shapes -----------------------------------

    def host_pages(self, rows: torch.Tensor, layer: int, logical: torch.Tensor) -> torch.Tensor:
        """Page ids (``homes.py``: host or GPU) of logical pages.

        rows: [B] int64; logical: [B, Hkv, K] int (entries < 0 give -1).
        Returns [B, Hkv, K] int64.
        """
        E = self.segment_pages
        safe = logical.clamp(min=0).long()
        seg = self.directory[rows, layer]  # [B, Hkv, n_seg]
        seg_ids = seg.gather(2, safe // E).long()  # [B, Hkv, K]
        return torch.where(logical >= 0, seg_ids * E + safe % E, -1)

    def token_slots(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[L, T, Hkv] flat token slots (page id * S + offset) of each token's K/V.

            page  = directory[row, l, h, (pos // S) // E] * E + (pos // S) % E
        """
        S, E = self.page_size, self.segment_pages
        page_idx = positions // S  # [T]
        seg = self.directory[token_rows, :, :, page_idx // E].long()  # [T, L, Hkv]
        page = seg * E + (page_idx % E)[:, None, None]
        return (page * S + (positions % S)[:, None, None]).permute(1, 0, 2).contiguous()

    def request_host_pages(self, request_id: str, num_pages: int) -> torch.Tensor:
        """[L, Hkv, num_pages] int64 page ids of the request's first pages in every
        layer, for prefill gathers (one lookup per step, not one per layer)."""
        E = self.segment_pages
        logical = torch.arange(num_pages, device=self.directory.device)  # [P']
        seg = self.directory[self.row(request_id)].long()  # [L, Hkv, n_seg]
        seg_ids = seg[:, :, logical // E]  # [L, Hkv, P']
        return seg_ids * E + logical % E

    # ---- accounting -------------------------------------------------------------------------

    def owned_segment_ids(self) -> list[int]:
        return [s for groups in self._request_to_segments.values() for g in groups for s in g]

    def host_mirror(self, request_id: str) -> list[list[int]]:
        return self._request_to_segments[request_id]

    def check_logical(self) -> None:
        """Every logical segment id is a request's or free, once; each request row's table
        entries are its ids, then -1."""
        owned = [g for ids in self._request_to_logical.values() for g in ids]
        check_partition(owned, self._free_logical, "logical segment")
        for rid, ids in self._request_to_logical.items():
            if len(ids) != len(self._request_to_segments[rid]):
                raise AssertionError(f"request {rid!r} has {len(ids)} logical segment ids for "
                                     f"{len(self._request_to_segments[rid])} logical segments")
            row = self.logical_ids[self.row(rid)].tolist()
            if row != ids + [-1] * (len(row) - len(ids)):
                raise AssertionError(f"logical segment row of {rid!r} disagrees with its ids")

    def metadata_bytes(self) -> dict[str, int]:
        """GPU bytes of the directory, host bytes of allocated level-2 entries, and the GPU
        bytes a flat table (one int32 per logical page) would take for the same capacity."""
        rows, L, Hkv, _ = self.directory.shape
        # Every logical segment holds one segment per (layer, KV head): a count per request, not
        # a walk over every id (the engine reads this each step, on the host).
        allocated = self.segments_per_logical_segment * sum(map(len, self._request_to_segments.values()))
        return {
            "gpu": self.directory.numel() * _ENTRY_BYTES,
            "host": allocated * _ENTRY_BYTES,
            "flat_gpu": rows * L * Hkv * self.max_pages_per_seq * _ENTRY_BYTES,
        }
