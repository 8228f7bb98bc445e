"""The request-level KV cache API; the only caller of the pool and the table.

The scheduler asks ``can_allocate`` / ``allocate`` in token counts and never sees a page
id. The model runner asks for ``slot_mapping`` and ``block_tables`` once per step.
"""

from __future__ import annotations

import torch

from spin_cluster.kvcache.base import KVCache
from spin_cluster.kvcache.free_list import check_partition
from spin_cluster.kvcache.page_pool import PagePool
from spin_cluster.kvcache.page_table import PageTable


class KVCacheManager(KVCache):
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        max_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.pool = PagePool(num_pages, page_size, head_dim, dtype, device)
        self.table = PageTable(
            num_layers, num_kv_heads, _ceil_div(max_model_len, page_size), max_seqs, device
        )

    # ---- capacity -----------------------------------------------------------------------

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Physical pages (all layers and heads) that ``num_tokens`` tokens take."""
        return _ceil_div(num_tokens, self.page_size) * self.table.pages_per_token_page

    def num_new_pages(self, request_id: str, num_tokens: int) -> int:
        have = self.table.num_logical_pages(request_id) if request_id in self.table else 0
        need = _ceil_div(num_tokens, self.page_size)
        return max(0, need - have) * self.table.pages_per_token_page

    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0) -> bool:
        """Could the request hold ``num_tokens`` tokens in total after ``allocate``?

        ``num_queued`` (requests waiting behind it) matters only to caches with per-request
        buffer shares; here it is ignored."""
        if request_id not in self.table and not self.table.has_free_row():
            return False
        return self.pool.can_allocate(self.num_new_pages(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len={self.max_model_len}")
        if request_id not in self.table:
            self.table.add(request_id)
        new = self.num_new_pages(request_id, num_tokens)
        if new:
            self.table.append(request_id, self.pool.allocate(new))

    def free(self, request_id: str) -> None:
        if request_id in self.table:
            self.pool.free(self.table.remove(request_id))

    def has(self, request_id: str) -> bool:
        return request_id in self.table

    def request_ids(self) -> list[str]:
        return self.table.request_ids()

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_pages

    def free_token_capacity(self) -> int:
        """Tokens that could still be stored (all layers and heads), ignoring fragmentation."""
        return self.pool.num_free // self.table.pages_per_token_page * self.page_size

    # ---- per-step views for the model runner ----------------------------------------------

    def rows(self, request_ids: list[str]) -> torch.Tensor:
        """[B] int64 table rows, on the table's device."""
        return torch.tensor([self.table.row(r) for r in request_ids], dtype=torch.long).to(
            self.table.table.device
        )

    def block_tables(self, rows: torch.Tensor, num_pages: int) -> torch.Tensor:
        """[B, L, Hkv, P'] page ids for the requests in ``rows``, first ``num_pages`` pages.

        Layer l's tables are the strided view ``[:, l]``, which the decode kernels take as is."""
        return self.table.table[rows, :, :, :num_pages]

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[L, T, Hkv] flat slots (page_id * S + offset) where each token's K/V is written.

        token_rows: [T] table row of each token's request; positions: [T] its position.

            slot = table[row, l, h, pos // S] * S + pos % S
        """
        page_idx = positions // self.page_size  # [T]
        offset = positions % self.page_size  # [T]
        pages = self.table.table[token_rows, :, :, page_idx]  # [T, L, Hkv]
        return (pages.long() * self.page_size + offset[:, None, None]).permute(1, 0, 2).contiguous()

    # ---- integrity --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every page is free or owned by exactly one request; table and pool agree."""
        check_partition(self.table.owned_page_ids(), self.pool.free_list, "pages")
        for rid in self.table.request_ids():
            host = self.table.host_pages(rid)
            if not host:
                continue
            row = self.table.row(rid)
            # [L, Hkv, n] on device vs host mirror [n, L*Hkv]
            dev = self.table.table[row, :, :, : len(host)].permute(2, 0, 1).reshape(len(host), -1)
            if dev.cpu().tolist() != host:
                raise AssertionError(f"device page table row of {rid!r} disagrees with the host mirror")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
