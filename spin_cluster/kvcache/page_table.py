"""Request -> physical page ids, per (layer, KV head).

Each running request owns one row of a device-resident table::

    table[row, layer, kv_head, p] = physical page id of logical page p
                                    (tokens p*S .. p*S+S-1 of that layer and head)

The table is written only when a request grows by a page (once every S tokens), so a decode
step reads it on the device without any host round trip. A host mirror of the ids is kept
for freeing and for the integrity check.

A (layer, KV head) may hold no page of a logical page: a sliding-window layer's pages behind
its window are freed (``drop``) or never taken (``kvcache/window.py``). Its entry is then
``no_page``, the pool's scratch page: a K/V write routed there is lost harmlessly, and no
attention reads it.
"""

from __future__ import annotations

from array import array

import torch

from spin_cluster.kvcache.free_list import FreeList


class PageTable:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        max_pages_per_seq: int,
        max_seqs: int,
        device: torch.device | str = "cpu",
        no_page: int = -1,
    ) -> None:
        self.num_layers = num_layers
        self.no_page = no_page
        self.num_kv_heads = num_kv_heads
        self.max_pages_per_seq = max_pages_per_seq
        # [R, L, Hkv, P] int32; unused entries are 0 and never read past a request's length.
        self.table = torch.zeros(
            max_seqs, num_layers, num_kv_heads, max_pages_per_seq, dtype=torch.int32, device=device
        )
        self._free_rows = FreeList(max_seqs)
        self._request_to_row: dict[str, int] = {}
        # Host mirror: request -> one list of L*Hkv ids per logical page, ordered [L, Hkv].
        self._request_to_pages: dict[str, list[list[int]]] = {}

    @property
    def pages_per_token_page(self) -> int:
        """Physical pages that one logical page (S tokens of every layer and head) takes."""
        return self.num_layers * self.num_kv_heads

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._request_to_row

    def has_free_row(self) -> bool:
        return len(self._free_rows) > 0

    def add(self, request_id: str) -> int:
        if request_id in self._request_to_row:
            raise KeyError(f"request {request_id!r} already has a page table row")
        if not len(self._free_rows):
            raise RuntimeError("page table full: no free request row")
        row = self._free_rows.take(1)[0]
        self._request_to_row[request_id] = row
        self._request_to_pages[request_id] = []
        return row

    def remove(self, request_id: str) -> list[list[int]]:
        """Drop the request; return the pages it held, one list of L*Hkv ids per logical page."""
        row = self._request_to_row.pop(request_id)
        self._free_rows.give([row])
        return self._request_to_pages.pop(request_id)

    def row(self, request_id: str) -> int:
        return self._request_to_row[request_id]

    def num_logical_pages(self, request_id: str) -> int:
        return len(self._request_to_pages[request_id])

    def append(self, request_id: str, page_ids: list[int]) -> None:
        """Add n logical pages; ``page_ids`` holds n * L * Hkv ids ordered [n, L, Hkv]
        (``no_page`` where a layer takes no page)."""
        per_page = self.pages_per_token_page
        if len(page_ids) % per_page:
            raise ValueError(f"{len(page_ids)} ids is not a multiple of L*Hkv={per_page}")
        n = len(page_ids) // per_page
        pages = self._request_to_pages[request_id]
        start = len(pages)
        if start + n > self.max_pages_per_seq:
            raise ValueError(
                f"request {request_id!r} would need {start + n} pages per head, "
                f"more than max_pages_per_seq={self.max_pages_per_seq}"
            )
        if not n:
            return
        pages.extend(page_ids[i * per_page : (i + 1) * per_page] for i in range(n))
        # [n, L, Hkv] -> [L, Hkv, n]; through an int32 array, 4x faster than torch.tensor over
        # the list (2M ids for a 128K prompt of an 8B model)
        block = torch.frombuffer(array("i", page_ids), dtype=torch.int32).view(n, self.num_layers, self.num_kv_heads)
        self.table[self.row(request_id), :, :, start : start + n] = block.permute(1, 2, 0).to(
            self.table.device
        )

    def drop(self, request_id: str, layers: list[int], start: int, stop: int) -> list[int]:
        """Free logical pages start .. stop-1 of ``layers`` (every KV head): their entries
        become ``no_page``. Returns the ids they held, ``no_page`` left out."""
        pages = self._request_to_pages[request_id][start:stop]
        H = self.num_kv_heads
        freed: list[int] = []
        for ids in pages:  # [L*Hkv], ordered [L, Hkv]
            for layer in layers:
                heads = slice(layer * H, (layer + 1) * H)
                freed.extend(pid for pid in ids[heads] if pid != self.no_page)
                ids[heads] = [self.no_page] * H
        if freed:
            index = torch.tensor(layers, device=self.table.device)
            self.table[self.row(request_id), index, :, start:stop] = self.no_page
        return freed

    def request_ids(self) -> list[str]:
        return list(self._request_to_row)

    def host_pages(self, request_id: str) -> list[list[int]]:
        return self._request_to_pages[request_id]
