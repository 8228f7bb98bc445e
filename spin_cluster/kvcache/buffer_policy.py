"""How the offloaded cache shapes its GPU buffer, past what the config exposes.

The serving config exposes two of the buffer's settings: ``cache.gpu_home_fraction`` (how the
GPU KV memory splits between home pages and the buffer) and ``cache.buffer_share`` (a share's
cap, as a multiple of the pages a step selects). The rest are mechanisms whose defaults every
served config runs with, and which only studies, baselines and tests move; they live here, not
in the config, and reach the cache builder through ``Engine(config, buffer_policy=...)``::

    setting          default  moved by
    pages_per_head   0        tests and benchmarks/buffer_policy.py: a fixed share per head
    per_head_shares  true     e2e.py --no-per-head-shares (shares by the widest head's budget)
    elastic_shares   true     benchmarks/buffer_policy.py (fixed shares: take one or wait)
    reuse            true     e2e.py's no-reuse baselines (dense-offload, sparse-no-buffer)
    segment_pages    64       check_spin_tokens.py and tests: small segments for tiny caches

The buffer's LRU resolution (``GpuBuffer``'s recency buckets), which nothing measured moves,
is the buffer's own constant and no setting at all.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BufferPolicy:
    """The GPU buffer's mechanisms (``Engine(config, buffer_policy=...)``); the default is what
    every served config runs."""

    # GPU buffer share per (request, layer, KV head), in pages, >= the pages a step selects
    # (sink + budget + local); 0: cache.buffer_share times those.
    pages_per_head: int = 0
    # With sparse.options.per_head_budgets (top-k): each head's share is sized by its own selection
    # (buffer_share times sink + its budget + local), not the widest head's, so a request's
    # share takes a fraction of the slots. Sized by the widest head, the buffer of max_num_seqs
    # requests took 42 of 100 GiB at 4 x 128K on Llama-3.1-8B shapes and pushed a sixth of the
    # pages to the host; by each head's own, 5 GiB, and every page stayed home.
    per_head_shares: bool = True
    # Each newcomer's share sized from the free slots and the queue behind it (down to its
    # mandatory pages); false: every request takes its whole share or waits.
    elastic_shares: bool = True
    # Selected pages stay in the buffer between steps (temporal locality); false: every page
    # a step selects is retrieved from the host tier again (the no-buffer baseline).
    reuse: bool = True
    # Host pages per second-level segment of the page table, a power of two in 1..1024: the
    # GPU directory is 1/segment_pages of a flat table, and a segment is a request's smallest
    # share of a tier (a request's last one may leave segment_pages - 1 pages per layer and
    # head unused).
    segment_pages: int = 64

    def __post_init__(self) -> None:
        if self.pages_per_head < 0:
            raise ValueError(f"BufferPolicy.pages_per_head={self.pages_per_head}: must be >= 0")
        E = self.segment_pages
        if not 1 <= E <= 1024 or E & (E - 1):
            raise ValueError(f"BufferPolicy.segment_pages={E}: use a power of two in 1..1024")


DEFAULT_POLICY = BufferPolicy()
