"""The request-level KV cache API; the only caller of the pool, the table and the prefix cache.

The scheduler asks ``can_allocate`` / ``allocate`` in token counts and never sees a page
id. The model runner asks for ``slot_mapping`` and ``block_tables`` once per step.

With prefix caching a newcomer's row starts with the published pages of its leading tokens
(``match_prefix``, then ``allocate`` with the hit), and ``commit`` publishes each row's full
pages as they are written (``prefix_cache.py``). Idle published pages count as free: a new
page comes from the free list first, else from evicting the least recently released one.

Sliding-window layers (Gemma 3) hold only their window's pages (``window.py``): ``allocate``
gives them pages only where a query yet to run reads, and ``commit`` frees at once those that
fell behind every such query. Capacity counts what a request really holds, so the cache
admits what fits. Prefix caching is refused with windows: a request's early pages of its
window layers are gone, so its full pages could not be shared whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit
from spin_cluster.kvcache.free_list import check_partition
from spin_cluster.kvcache.page_pool import PagePool
from spin_cluster.kvcache.page_table import PageTable
from spin_cluster.kvcache.prefix_cache import ChainKey, PrefixCache
from spin_cluster.kvcache.window import LayerWindows


class KVCacheManager(KVCache):
    attention_backend = "paged"

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
        enable_prefix_caching: bool = False,
        layer_windows: Sequence[int | None] = (),
    ) -> None:
        """``layer_windows``: per layer its sliding window in tokens or None (full
        attention); empty: every layer attends to the whole context."""
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.windows = LayerWindows.of(layer_windows, num_layers, page_size)
        if enable_prefix_caching and self.windows.any:
            raise ValueError("prefix caching cannot share the pages of a model with sliding-window "
                             "layers (they free pages behind their window); turn it off")
        self.prefix_caching = enable_prefix_caching
        self.pool = PagePool(num_pages, page_size, head_dim, dtype, device)
        self.table = PageTable(
            num_layers, num_kv_heads, _ceil_div(max_model_len, page_size), max_seqs, device,
            no_page=self.pool.scratch_page_id,
        )
        self.prefixes = PrefixCache()
        # request -> (its leading pages that are published, the key of the last of them):
        # ``commit`` goes on from there, so each page is hashed once.
        self._published: dict[str, tuple[int, ChainKey | None]] = {}
        # request -> per window group (``windows.groups``), its logical pages before this one
        # are freed: ``commit`` goes on from there.
        self._first_live: dict[str, list[int]] = {}

    # ---- capacity -----------------------------------------------------------------------

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Physical pages (all layers and heads) that ``num_tokens`` tokens take at most; a
        sliding-window layer's are bounded by its window (``LayerWindows.most_pages``)."""
        return self.windows.most_pages(num_tokens) * self.num_kv_heads

    def num_new_pages(self, request_id: str, num_tokens: int) -> int:
        have = self.table.num_logical_pages(request_id) if request_id in self.table else 0
        return self.windows.num_new_pages(have, num_tokens) * self.num_kv_heads

    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                     prefix: PrefixHit = NO_PREFIX) -> bool:
        """Could the request hold ``num_tokens`` tokens in total after ``allocate``?

        ``num_queued`` (requests waiting behind it) matters only to caches with per-request
        buffer shares; here it is ignored. A newcomer's ``prefix`` pages are not new, but
        the idle ones among them stop being free once it holds them."""
        if request_id not in self.table and not self.table.has_free_row():
            return False
        per = self.table.pages_per_token_page
        new = self.num_new_pages(request_id, num_tokens) - len(prefix.pages) * per
        return new <= self.num_free_pages - self.prefixes.num_idle_among(prefix.pages) * per

    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                 prefix: PrefixHit = NO_PREFIX) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len={self.max_model_len}")
        if request_id not in self.table:
            self.table.add(request_id)
            self._first_live[request_id] = [0] * len(self.windows.groups)
            self._attach(request_id, prefix)
        elif prefix.pages:
            raise ValueError(f"request {request_id!r} already has pages: a prefix is attached on admission only")
        new = self.num_new_pages(request_id, num_tokens)
        if not new:
            return
        self._make_room(new)
        page_ids = self.pool.allocate(new)
        if self.windows.any:
            page_ids = self._spread(page_ids, self.table.num_logical_pages(request_id), num_tokens)
        self.table.append(request_id, page_ids)

    def _spread(self, page_ids: list[int], have: int, num_tokens: int) -> list[int]:
        """The new logical pages' ids ordered [n, L, Hkv], ``no_page`` where a window layer
        takes none (``LayerWindows.new_page_layers``)."""
        H, no_page = self.num_kv_heads, self.table.no_page
        taken = iter(page_ids)
        out: list[int] = []
        for layers in self.windows.new_page_layers(have, num_tokens):
            for gets_page in layers:
                out.extend([next(taken) for _ in range(H)] if gets_page else [no_page] * H)
        return out

    def free(self, request_id: str) -> None:
        if request_id in self.table:
            self._published.pop(request_id, None)
            self._first_live.pop(request_id, None)
            released = self.prefixes.release(self.table.remove(request_id))
            self.pool.free([pid for pid in released if pid != self.table.no_page])

    def has(self, request_id: str) -> bool:
        return request_id in self.table

    def request_ids(self) -> list[str]:
        return self.table.request_ids()

    @property
    def num_free_pages(self) -> int:
        """Free pages and idle published ones (evicted when a request needs them)."""
        return self.pool.num_free + self.prefixes.num_idle * self.table.pages_per_token_page

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_pages

    def num_layer_pages(self, request_id: str) -> list[int]:
        """[L] pages that each layer of ``request_id`` holds, per KV head."""
        H, no_page = self.num_kv_heads, self.table.no_page
        pages = self.table.host_pages(request_id)
        return [sum(ids[layer * H] != no_page for ids in pages) for layer in range(self.num_layers)]

    def free_token_capacity(self) -> int:
        """Tokens that could still be stored (all layers and heads), ignoring fragmentation."""
        return self.num_free_pages // self.table.pages_per_token_page * self.page_size

    # ---- prefix caching -------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        if not self.prefix_caching:
            return NO_PREFIX
        pages = self.prefixes.match(token_ids, self.page_size)
        return PrefixHit(len(pages) * self.page_size, tuple(pages)) if pages else NO_PREFIX

    def commit(self, request_id: str, num_tokens: int, token_ids: Callable[[int, int], list[int]]) -> None:
        if request_id not in self.table:
            return
        if self.windows.any:
            self._free_behind_windows(request_id, num_tokens)
        if self.prefix_caching:
            self._publish(request_id, num_tokens, token_ids)

    def _free_behind_windows(self, request_id: str, num_tokens: int) -> None:
        """Give back each window layer's pages that no query at ``num_tokens`` or later reads."""
        first_live = self._first_live[request_id]
        have = self.table.num_logical_pages(request_id)
        for g, (window, layers) in enumerate(self.windows.groups):
            first = min(have, self.windows.first_needed_page(window, num_tokens))
            if first > first_live[g]:
                self.pool.free(self.table.drop(request_id, list(layers), first_live[g], first))
                first_live[g] = first

    def _publish(self, request_id: str, num_tokens: int, token_ids: Callable[[int, int], list[int]]) -> None:
        S = self.page_size
        done, key = self._published.get(request_id, (0, None))
        full = num_tokens // S
        if full <= done:
            return
        tokens = token_ids(done * S, full * S)  # pages done .. full-1, S tokens each
        for i, page_ids in enumerate(self.table.host_pages(request_id)[done:full]):
            key = self.prefixes.publish(key, tuple(tokens[i * S : (i + 1) * S]), page_ids)
        self._published[request_id] = (full, key)

    def _attach(self, request_id: str, prefix: PrefixHit) -> None:
        """A newcomer's row starts with the hit's pages (before ``_make_room``, which must not evict them)."""
        if not prefix.pages:
            return
        self.prefixes.acquire(prefix.pages)
        self.table.append(request_id, [pid for page in prefix.pages for pid in page.page_ids])
        self._published[request_id] = (len(prefix.pages), prefix.pages[-1].key)

    def _make_room(self, num_pages: int) -> None:
        """Evict idle published pages until the pool has ``num_pages`` free."""
        short = num_pages - self.pool.num_free
        if short > 0:
            self.pool.free(self.prefixes.evict(_ceil_div(short, self.table.pages_per_token_page)))

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
        """Every page is free, private to one request, shared by as many requests as its
        refcount, or idle (refcount 0, in the LRU); table, pool and prefix cache agree; no
        window layer holds a page behind its window's freed ones."""
        held = [page for rid in self.table.request_ids() for page in self.table.host_pages(rid)]
        if self.prefix_caching:  # (never with windows, so every page's first id is a page)
            self.prefixes.check_integrity(held)
            held = list({page[0]: page for page in held}.values())  # a shared page once
        no_page = self.table.no_page
        owned = [pid for page in held for pid in page if pid != no_page] + self.prefixes.idle_page_ids()
        check_partition(owned, self.pool.free_list, "pages")
        rows = set(self.table.request_ids())
        stale = (self._published.keys() - rows) | (self._first_live.keys() ^ rows)
        if stale:
            raise AssertionError(f"published or freed-page counts disagree with the rows: {sorted(stale)}")
        for rid in rows:
            self._check_freed(rid)
        for rid in self.table.request_ids():
            host = self.table.host_pages(rid)
            if not host:
                continue
            row = self.table.row(rid)
            # [L, Hkv, n] on device vs host mirror [n, L*Hkv]
            dev = self.table.table[row, :, :, : len(host)].permute(2, 0, 1).reshape(len(host), -1)
            if dev.cpu().tolist() != host:
                raise AssertionError(f"device page table row of {rid!r} disagrees with the host mirror")

    def _check_freed(self, request_id: str) -> None:
        """A window layer's pages before its group's first live page are all ``no_page``."""
        H, pages = self.num_kv_heads, self.table.host_pages(request_id)
        for (window, layers), first in zip(self.windows.groups, self._first_live[request_id]):
            for p, ids in enumerate(pages[:first]):
                if any(pid != self.table.no_page for layer in layers for pid in ids[layer * H : (layer + 1) * H]):
                    raise AssertionError(f"{request_id!r} holds page {p} of a window-{window} layer it freed")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
