"""An engine's plain step stats and cache sizes, turned into the report the planner collects.

Runs on the engine loop's thread (it reads the engine's cache between steps).
"""

from __future__ import annotations

import time
from typing import Any

from spin_cluster.deployments.messages import EngineReport

# Token pages used to measure a cache's pages per token page; a multiple of every
# segment size (BufferPolicy.segment_pages <= 1024), so whole segments divide it.
_PROBE_TOKEN_PAGES = 1024


def free_kv_tokens(kv: Any, num_free_pages: int) -> int:
    """Tokens (all layers and heads) that the free pages could still hold."""
    S = kv.page_size
    pages_per_token_page = kv.pages_for_tokens(S * _PROBE_TOKEN_PAGES) / _PROBE_TOKEN_PAGES
    return int(num_free_pages // pages_per_token_page) * S


def engine_report(engine: Any, replica_id: str, num_requests_total: int = 0) -> EngineReport:
    st = engine.last_stats
    kv = engine.kv
    buffer = kv.buffer
    if buffer is None:  # device pages only
        kv_pages = _pages("gpu", kv.num_free_pages, kv.num_total_pages)
    else:  # home pages on the GPU and the host, the buffer's page slots on the GPU
        tiers = kv.tier_pages()
        kv_pages = {
            **_pages("gpu", tiers["gpu"][1] - tiers["gpu"][0], tiers["gpu"][1]),
            **_pages("host", tiers["host"][1] - tiers["host"][0], tiers["host"][1]),
            **_pages("gpu_buffer", buffer.num_free_slots, buffer.num_slots),
        }
    return EngineReport(
        replica_id=replica_id,
        reported_s=time.time(),
        free_kv_tokens=free_kv_tokens(kv, kv.num_free_pages),
        num_requests_total=num_requests_total,
        num_running=engine.scheduler.num_running(),
        num_waiting=engine.scheduler.num_waiting(),
        kv_pages=kv_pages,
        kv_bytes={key: n * _page_bytes(kv) for key, n in kv_pages.items()},
        metadata_bytes={"gpu": st.metadata_gpu_bytes, "host": st.metadata_host_bytes},
        allocated_bytes=allocated_bytes(kv),
        counters={
            "buffer_lookups": st.buffer_lookups_total,
            "buffer_hits": st.buffer_hits_total,
            "retrieved_bytes": st.retrieved_bytes_total,
            "evicted_pages": st.evicted_pages_total,
            "promoted_pages": st.buffer_misses_total,
            "spilled_pages": getattr(st, "spilled_pages_total", 0),
            "preemptions": getattr(st, "preemptions_total", 0),
            "prefix_cache_queries": st.prefix_cache_queries_total,
            "prefix_cache_hits": st.prefix_cache_hits_total,
            # Head-parallel engines (rank 0's stats): the bubble summed over steps and layers,
            # and each rank's attention seconds; a plain engine is one rank, never waiting.
            "attention_bubble_s": getattr(st, "attention_bubble_s_total", 0.0),
        },
        attention_rank_s={**{str(r): 0.0 for r in range(getattr(engine, "num_ranks", 1))},
                          **(getattr(st, "attention_rank_s_total", None) or {})},
    )


def allocated_bytes(kv: Any) -> dict[str, int]:
    """tier -> bytes its KV pages' allocation holds, free pages included: "gpu" the device
    pages (the paged pool, or the buffer's slots and GPU home pages), "host" the host tier's
    one piece (what the memory plan counted)."""
    host = getattr(getattr(kv, "spin", kv), "host", None)  # the offloaded cache, alone or in the hybrid
    pool = getattr(getattr(kv, "paged", kv), "pool", None)  # the paged cache, alone or in the hybrid
    device = ([kv.buffer.k_slots, kv.buffer.v_slots] if kv.buffer is not None else []) + (
        [pool.k_pages, pool.v_pages] if pool is not None else [])
    return {"gpu": sum(t.numel() * t.element_size() for t in device), "host": host.nbytes if host else 0}


def _page_bytes(kv: Any) -> int:
    """K and V bytes of one page of either cache."""
    if kv.buffer is not None:
        return kv.buffer.page_bytes
    pool = kv.pool
    return 2 * pool.k_pages[0].numel() * pool.k_pages.element_size()


def _pages(tier: str, num_free: int, num_total: int) -> dict[tuple[str, str], int]:
    return {(tier, "free"): num_free, (tier, "used"): num_total - num_free}
