"""Which of a request's pages each layer holds: every page for a full-attention layer, for a
sliding-window layer (Gemma 3) only the pages that a query yet to run can read.

A query at position p of a layer with window w reads keys p - w + 1 .. p. Once the queries
left are at p or later, the pages wholly before the page of key p - w + 1 are dead::

    S = 4, w = 10, p = 17: keys 8 .. 17
    positions   0 . . 3 | 4 . . 7 | 8 . . 11 | 12 . . 15 | 16 17
    pages          0    |    1    |    2     |     3     |   4
                   dead           |  live ....................

    first_needed_page(w, p) = max(0, p - w + 1) // S        (here 2)

A step that computes positions c .. e-1 gives a window layer pages only from
``first_needed_page(w, e - 1)`` on: the step's earlier queries read the chunk's own K/V (the
backend keeps them), and no later query reads positions before that page. Its K/V of earlier
positions go to the pool's scratch page. Once the step ran, the pages before
``first_needed_page(w, e)`` are freed (``KVCacheManager.commit``). So between steps a window
layer holds at most ceil(w / S) + 1 pages (w tokens straddle one page edge more than they
fill); while a later prompt chunk runs it also holds the window before the chunk, which the
chunk's first queries read: at most 2 * (ceil(w / S) + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerWindows:
    """A model's per-layer windows as the KV cache uses them; counts are per KV head."""

    page_size: int  # S, tokens per page
    num_layers: int  # L
    # (window in tokens, the layers with it), one entry per distinct window, layers ascending
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], num_layers: int, page_size: int) -> LayerWindows:
        """``layer_windows``: per layer its window or None (full attention); empty: none has one."""
        if layer_windows and len(layer_windows) != num_layers:
            raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            if window is not None:
                if window < 1:
                    raise ValueError(f"layer {layer} has window {window}; a window is >= 1 token")
                by_window.setdefault(window, []).append(layer)
        groups = tuple((w, tuple(layers)) for w, layers in sorted(by_window.items()))
        return cls(page_size, num_layers, groups)

    @property
    def any(self) -> bool:
        return bool(self.groups)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - sum(len(layers) for _, layers in self.groups)

    def first_needed_page(self, window: int, position: int) -> int:
        """The first page that a query at ``position`` (or later) of a ``window`` layer reads."""
        return max(0, position - window + 1) // self.page_size

    def num_new_pages(self, have: int, num_tokens: int) -> int:
        """Pages (summed over layers) that growing from ``have`` logical pages to ``num_tokens``
        tokens adds: each new logical page for every full layer, and for a window layer only
        from the first page the step's last query reads."""
        need = -(-num_tokens // self.page_size)
        if need <= have:
            return 0
        new = self.num_full_layers * (need - have)
        for window, layers in self.groups:
            first = self.first_needed_page(window, num_tokens - 1)
            new += len(layers) * max(0, need - max(have, first))
        return new

    def new_page_layers(self, have: int, num_tokens: int) -> list[list[bool]]:
        """[n][L]: whether layer l gets a page of logical page have + i when the request
        grows to ``num_tokens`` tokens (n new logical pages), as ``num_new_pages`` counts."""
        need = -(-num_tokens // self.page_size)
        first = [0] * self.num_layers
        for window, layers in self.groups:
            for layer in layers:
                first[layer] = self.first_needed_page(window, num_tokens - 1)
        return [[page >= f for f in first] for page in range(have, need)]

    def most_pages(self, num_tokens: int) -> int:
        """The most pages (summed over layers) a request of ``num_tokens`` tokens holds at once:
        every page of a full layer; of a window layer the window before a prompt chunk and
        the window at its end (see the module's docstring), never more than a full layer."""
        pages = -(-num_tokens // self.page_size)
        most = self.num_full_layers * pages
        for window, layers in self.groups:
            most += len(layers) * min(pages, 2 * (-(-window // self.page_size) + 1))
        return most
