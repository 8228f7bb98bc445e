"""Plain counters the engine emits each step; only deployments/ turns them into metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    step_s: float = 0.0
    # Prefix caching (cumulative since start): tokens of admitted requests looked up in the
    # cache, and those whose K/V were found there (hit rate = hits / queries).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Offloaded cache only (cumulative since start): buffer lookups of selected pages, hits,
    # misses (pages retrieved from the host tier), evictions, bytes retrieved.
    buffer_lookups_total: int = 0
    buffer_hits_total: int = 0
    buffer_misses_total: int = 0
    evicted_pages_total: int = 0
    retrieved_bytes_total: int = 0
    # Offloaded cache (cumulative): pages moved GPU -> host to make room (spills).
    spilled_pages_total: int = 0
    # Requests preempted since start (their pages freed, recomputed later).
    preemptions_total: int = 0
    # Page-table bytes: GPU directory, host level 2, and a flat GPU table's for comparison.
    metadata_gpu_bytes: int = 0
    metadata_host_bytes: int = 0
    metadata_flat_gpu_bytes: int = 0
    # Head-parallel engines only. This step: attention seconds of each rank (summed over
    # layers) and the bubble, summed over layers: slowest rank minus mean rank, i.e. what an
    # average rank waits at the output-projection all-reduce. Totals: cumulative since start,
    # per rank keyed "0", "1", ...
    attention_rank_s: tuple[float, ...] = ()
    attention_bubble_s: float = 0.0
    attention_rank_s_total: dict[str, float] = field(default_factory=dict)
    attention_bubble_s_total: float = 0.0
