"""The offloaded cache of a model with sliding-window layers (Gemma 3): two caches, one interface.

A sliding-window layer reads at most its window (512 tokens for Gemma 3), so sparse
attention has nothing to save there; only the full-attention ("global") layers read a
context that grows. So the layers are split once, and each part goes to the cache made for
it::

    model layers   0  1  2  3  4  5  6  7 ...      (Gemma 3: every 6th is global)
    window         w  w  w  w  w  .  w  w
    part           P0 P1 P2 P3 P4 S0 P5 P6 ...     P: the paged cache's layer, S: the Spin cache's

    KVCacheManager       the window layers only; frees their pages behind the window
    OffloadedKVManager   the global layers only; home pages, host tier, GPU buffer, sized
                         for those layers (and the sparse algorithm with them)

The scheduler sees one ``KVCache``: a request is admitted or grows when both parts have room
(``can_allocate`` asks both), ``allocate``, ``commit`` and ``free`` go to both. Page counts
(``num_free_pages``, ``pages_for_tokens``) are the Spin part's: the builder sizes the paged
part for every request row's windows at full length, so the global layers are what bounds
admission; ``can_allocate`` still asks the paged part, so a smaller one stays correct.

Each part gives a request its own table row. The runner knows the Spin part's row (``row``);
``paged_rows`` maps it to the paged part's on the device, one lookup a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.offloaded import OffloadedKVManager


@dataclass(frozen=True)
class LayerSplit:
    """A model's layers as the two parts number them."""

    window_layers: tuple[int, ...]  # model layer ids of the sliding-window layers, ascending
    global_layers: tuple[int, ...]  # model layer ids of the full-attention layers, ascending

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> LayerSplit:
        """``layer_windows``: per model layer its window in tokens, or None (full attention)."""
        return cls(tuple(i for i, w in enumerate(layer_windows) if w is not None),
                   tuple(i for i, w in enumerate(layer_windows) if w is None))

    @property
    def num_layers(self) -> int:
        return len(self.window_layers) + len(self.global_layers)

    def part_of(self) -> list[tuple[bool, int]]:
        """[L] per model layer: (whether it is a window layer, its layer index in that part)."""
        out = [(False, 0)] * self.num_layers
        for i, layer in enumerate(self.window_layers):
            out[layer] = (True, i)
        for i, layer in enumerate(self.global_layers):
            out[layer] = (False, i)
        return out


class HybridKVCache(KVCache):
    attention_backend = "hybrid"
    prefix_caching = False

    def __init__(self, split: LayerSplit, paged: KVCacheManager, spin: OffloadedKVManager) -> None:
        if not split.global_layers:
            raise ValueError("a model whose every layer has a sliding window needs no Spin cache: "
                             "set cache.kind=paged")
        if paged.num_layers != len(split.window_layers) or spin.num_layers != len(split.global_layers):
            raise ValueError(f"the parts hold {paged.num_layers} window and {spin.num_layers} global layers; "
                             f"the model has {len(split.window_layers)} and {len(split.global_layers)}")
        self.split = split
        self.paged = paged
        self.spin = spin
        self.page_size = spin.page_size
        self.num_layers = split.num_layers
        self.num_kv_heads = spin.num_kv_heads
        self.max_model_len = spin.max_model_len
        self.buffer = spin.buffer
        max_rows = spin.directory.directory.shape[0]
        # [R] Spin row -> the paged part's row of the same request
        self._paged_row = torch.zeros(max_rows, dtype=torch.long, device=paged.table.table.device)

    # ---- capacity: both parts ---------------------------------------------------------------

    def pages_for_tokens(self, num_tokens: int) -> int:
        return self.spin.pages_for_tokens(num_tokens)

    def can_allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                     prefix: PrefixHit = NO_PREFIX) -> bool:
        return (self.spin.can_allocate(request_id, num_tokens, num_queued)
                and self.paged.can_allocate(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0,
                 prefix: PrefixHit = NO_PREFIX) -> None:
        if prefix.pages:
            raise ValueError("the hybrid cache shares no prefix pages")
        new = not self.spin.has(request_id)
        self.spin.allocate(request_id, num_tokens, num_queued)
        self.paged.allocate(request_id, num_tokens)
        if new:
            self._paged_row[self.spin.row(request_id)] = self.paged.table.row(request_id)

    def commit(self, request_id: str, num_tokens: int, token_ids: Callable[[int, int], list[int]]) -> None:
        self.paged.commit(request_id, num_tokens, token_ids)  # frees pages behind the windows
        self.spin.commit(request_id, num_tokens, token_ids)

    def free(self, request_id: str) -> None:
        self.spin.free(request_id)
        self.paged.free(request_id)

    def has(self, request_id: str) -> bool:
        return self.spin.has(request_id)

    def request_ids(self) -> list[str]:
        return self.spin.request_ids()

    @property
    def num_free_pages(self) -> int:
        return self.spin.num_free_pages

    @property
    def num_total_pages(self) -> int:
        return self.spin.num_total_pages

    # ---- rows and the Spin part's views (stats read them as an offloaded cache's) -------------

    def row(self, request_id: str) -> int:
        """The request's Spin row: what the runner's token rows hold."""
        return self.spin.row(request_id)

    def paged_rows(self, spin_rows: torch.Tensor) -> torch.Tensor:
        """[T] Spin rows -> [T] the paged part's rows of the same requests (on the device)."""
        return self._paged_row[spin_rows]

    @property
    def host(self):
        return self.spin.host

    @property
    def num_spilled_segments(self) -> int:
        return self.spin.num_spilled_segments

    def reset_counters(self) -> None:
        self.spin.reset_counters()  # the paged part counts nothing

    def tier_pages(self) -> dict[str, tuple[int, int]]:
        return self.spin.tier_pages()

    def metadata_bytes(self) -> dict[str, int]:
        return self.spin.metadata_bytes()

    # ---- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Each part's own check, both parts hold the same requests, and the row map agrees."""
        self.spin.check_integrity()
        self.paged.check_integrity()
        spin_ids, paged_ids = sorted(self.spin.request_ids()), sorted(self.paged.request_ids())
        if spin_ids != paged_ids:
            raise AssertionError(f"the parts hold different requests: spin {spin_ids}, paged {paged_ids}")
        for rid in spin_ids:
            if int(self._paged_row[self.spin.row(rid)]) != self.paged.table.row(rid):
                raise AssertionError(f"the row map of {rid!r} disagrees with the paged part's row")
