"""Sizing the KV cache: bytes into pages, buffer slots and segments.

What a GPU and the host give the KV cache, and how many pages that is, for the cache builder
(``engine.cache_builder``), the head-parallel ranks (``parallel.attention``: each sizes its
cache, then the ranks agree on the smallest) and the server's preflight and memory plan
(``deployments.preflight``), which must reach the same figures before any cache exists::

    GPU bytes  cache.kv_cache_gib, else what cache.gpu_memory_utilization of the GPU leaves
               past the weights and a step's activations (``utilization_kv_bytes``; a fixed
               2 GiB on the CPU), less the sparse algorithm's index
      paged      -> pages (``num_gpu_pages``)
      hybrid     -> the window layers' pages (``window_gpu_pages``), the rest as offloaded
      offloaded  -> page slots (``gpu_page_slots``) -> buffer slots + GPU home segments
                    (``split_gpu_pages``)
    host bytes cache.host_kv_gib (8 GiB) -> host segments (``host_tier_segments``)

Each figure is capped by what max_num_seqs requests could use at full length
(``full_length_segments``); ``full_length_bytes`` is that cap in bytes, the sizes of a cache
that holds every page of a full batch in either tier (the accuracy eval's engines).
"""

from __future__ import annotations

import math

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.kernels.fp8_pages import FP8_DTYPE
from spin_cluster.kvcache.host_tier import HostTier
from spin_cluster.kvcache.page_pool import PagePool
from spin_cluster.kvcache.window import LayerWindows
from spin_cluster.models.config import ModelConfig

CPU_DEFAULT_KV_GIB = 2.0
DEFAULT_HOST_KV_GIB = 8.0
# With GPU home pages (cache.gpu_home_fraction null): the buffer's slots as a multiple of what
# max_num_seqs requests select per step, and at most this part of the GPU KV memory.
_BUFFER_MULTIPLE = 1.25
_MOST_BUFFER_FRACTION = 0.5
# The hybrid cache: at most this part of the GPU KV memory for the sliding-window layers'
# pages (they need only their windows; the rest is the global layers' Spin cache).
_MOST_WINDOW_FRACTION = 0.5
_FLOAT32_BYTES = 4


def utilization_kv_bytes(total_bytes: float, utilization: float, engine_bytes: float, activation_bytes: float) -> float:
    """The KV cache's bytes when the engine may use ``utilization`` of a GPU of ``total_bytes``
    (cache.gpu_memory_utilization), as vLLM sizes it: what the model leaves::

        total_bytes x utilization = engine_bytes + activation_bytes + KV bytes

    ``engine_bytes``: what the engine holds on the GPU before its cache (the weights);
    ``activation_bytes``: a step's activations (``step_activation_bytes``). <= 0 when the
    model leaves nothing."""
    return total_bytes * utilization - engine_bytes - activation_bytes


def step_activation_bytes(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int) -> int:
    """An upper estimate of one step's activations: scheduler.max_num_batched_tokens tokens
    through one layer's widest tensors at once (the residual stream and its norm, the fused
    q/k/v projection, the MLP's fused gate/up projection and its product), one layer's K and V
    of a whole context (a prefill chunk's earlier context, gathered) and float32 logits of
    max_num_seqs rows."""
    sc, itemsize = config.scheduler, torch.empty((), dtype=dtype).element_size()
    per_token = 2 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 3 * mc.intermediate_size
    context = 2 * max_model_len * mc.num_kv_heads * mc.head_dim
    logits = sc.max_num_seqs * mc.vocab_size * _FLOAT32_BYTES
    return (sc.max_num_batched_tokens * per_token + context) * itemsize + logits


def gpu_budget_bytes(config: SpinConfig, device: torch.device, activation_bytes: float, held_bytes: float = 0) -> float:
    """The KV cache's bytes on ``device``: its pages and the sparse algorithm's index, of which
    ``held_bytes`` are allocated already (an index sized by max_num_seqs x max_model_len).
    cache.kv_cache_gib, else what cache.gpu_memory_utilization leaves past the weights and
    ``activation_bytes`` (``step_activation_bytes``; a fixed size on the CPU). A size the GPU
    cannot hold is refused here, with what holds the rest, rather than by an out-of-memory
    error in the middle of the allocation."""
    gib = config.cache.kv_cache_gib
    if device.type != "cuda":
        return (CPU_DEFAULT_KV_GIB if gib is None else gib) * 2**30
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated  # torch's cache is reusable
    if gib is None:
        return _utilization_budget(config, total, free, allocated - held_bytes, activation_bytes, held_bytes)
    if gib * 2**30 - held_bytes > free:
        raise ValueError(
            f"cache.kv_cache_gib={gib:g} GiB does not fit: {(free + held_bytes) / 2**30:.1f} GiB of the GPU is free "
            f"after the model's weights ({(allocated - held_bytes) / 2**30:.1f} GiB allocated); lower "
            "cache.kv_cache_gib")
    if gib * 2**30 < held_bytes:
        raise ValueError(
            f"cache.kv_cache_gib={gib:g} GiB cannot hold the sparse algorithm's index ({held_bytes / 2**30:.1f} GiB: "
            "it is sized scheduler.max_num_seqs x model.max_model_len); raise cache.kv_cache_gib or lower "
            "scheduler.max_num_seqs or model.max_model_len")
    return gib * 2**30


def _utilization_budget(config: SpinConfig, total: float, free: float, engine_bytes: float, activation_bytes: float,
                        held_bytes: float) -> float:
    """``utilization_kv_bytes`` on this GPU, refused where it leaves the KV cache nothing or
    asks for more than is free (another process holds the rest)."""
    utilization = config.cache.gpu_memory_utilization
    kv = utilization_kv_bytes(total, utilization, engine_bytes, activation_bytes)
    if kv <= held_bytes:
        raise ValueError(
            f"cache.gpu_memory_utilization={utilization:g} ({total * utilization / 2**30:.1f} GiB of the GPU) leaves "
            f"the KV cache nothing: the model holds {engine_bytes / 2**30:.1f} GiB and a step's activations take "
            f"{activation_bytes / 2**30:.1f} GiB (scheduler.max_num_batched_tokens), the sparse algorithm's index "
            f"{held_bytes / 2**30:.1f} GiB; raise it, lower scheduler.max_num_batched_tokens or set cache.kv_cache_gib")
    if kv - held_bytes > free - activation_bytes:
        raise ValueError(
            f"cache.gpu_memory_utilization={utilization:g} gives the KV cache {kv / 2**30:.1f} GiB but "
            f"{max(0.0, free - activation_bytes) / 2**30:.1f} GiB of the GPU is free beside a step's activations "
            "(other processes hold the rest); lower cache.gpu_memory_utilization or set cache.kv_cache_gib")
    return kv


def num_gpu_pages(config: SpinConfig, mc: ModelConfig, dtype, device, max_model_len: int) -> int:
    page_bytes = PagePool.bytes_per_page(config.cache.page_size, mc.head_dim, dtype)
    activation_bytes = step_activation_bytes(config, mc, dtype, max_model_len)
    per_token_page = mc.num_layers * mc.num_kv_heads
    # Never more than every request slot could use at full length (a sliding-window layer
    # only its window's pages).
    windows = LayerWindows.of(mc.layer_windows, mc.num_layers, config.cache.page_size)
    most = config.scheduler.max_num_seqs * windows.most_pages(max_model_len) * mc.num_kv_heads
    return max(per_token_page, min(int(gpu_budget_bytes(config, device, activation_bytes) // page_bytes), most))


def window_gpu_pages(config: SpinConfig, windows: LayerWindows, num_kv_heads: int, page_bytes: int,
                     gpu_bytes: float, max_model_len: int) -> int:
    """GPU pages of the hybrid cache's sliding-window layers (``windows``): every request row's
    windows at full length, in at most ``_MOST_WINDOW_FRACTION`` of ``gpu_bytes``."""
    one_request = windows.most_pages(max_model_len) * num_kv_heads
    num_pages = min(config.scheduler.max_num_seqs * one_request, int(gpu_bytes * _MOST_WINDOW_FRACTION // page_bytes))
    if num_pages < one_request:
        raise ValueError(f"the sliding-window layers' {num_pages} GPU pages cannot hold one request's windows; "
                         "give the KV cache more memory (cache.kv_cache_gib, or cache.gpu_memory_utilization where "
                         "that is null)")
    return num_pages


def gpu_page_slots(gpu_bytes: float, slot_bytes: int, index_per_slot: float, num_host_pages: int) -> int:
    """Page slots (buffer slots and GPU home pages) of the offloaded cache in ``gpu_bytes``,
    which also hold the index of every page either tier holds (Select reads it on the GPU;
    ``index_per_slot`` bytes a page, 0 for an index per request row)::

        slots * slot_bytes + index_per_slot * (slots + num_host_pages) <= gpu_bytes

    counting buffer slots as pages (a slight overcount)."""
    host_index = index_per_slot * num_host_pages
    return max(0, int((gpu_bytes - host_index) // (slot_bytes + index_per_slot)))


def split_gpu_pages(config: SpinConfig, all_slots: int, least_slots: int, max_pages: int,
                    per_column: int, segment_pages: int) -> tuple[int, int]:
    """The GPU KV memory's ``all_slots`` pages as (buffer slots, GPU home segments), by
    ``cache.gpu_home_fraction``; null: the buffer takes what max_num_seqs requests select per
    step (``least_slots`` each) 1.25 times over, at most half, and home pages the rest, never
    more than max_num_seqs requests of ``max_pages`` pages per (layer, KV head) use, in segments of
    ``segment_pages``."""
    cc, sc = config.cache, config.scheduler
    fraction = cc.gpu_home_fraction
    if fraction is None:
        buffer = min(math.ceil(_BUFFER_MULTIPLE * sc.max_num_seqs * least_slots), int(all_slots * _MOST_BUFFER_FRACTION))
        buffer = max(buffer, min(least_slots, all_slots))
    else:
        buffer = all_slots - int(all_slots * fraction)
    E = segment_pages
    most_segments = sc.max_num_seqs * -(-max_pages // E) * per_column
    return buffer, min((all_slots - buffer) // E, most_segments)


def host_dtype(config: SpinConfig, dtype: torch.dtype) -> torch.dtype:
    """The host pages' dtype: ``cache.host_kv_dtype`` (fp8: e4m3, "auto": the model's)."""
    return FP8_DTYPE if config.cache.host_kv_dtype == "fp8" else dtype


def host_tier_segments(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int,
                       segment_pages: int) -> int:
    """Segments of ``segment_pages`` pages in the offloaded cache's host tier:
    ``cache.host_kv_gib`` (null: 8 GiB) of pages in ``host_dtype``, never more than every
    request row could use at full length."""
    cc = config.cache
    host_gib = DEFAULT_HOST_KV_GIB if cc.host_kv_gib is None else cc.host_kv_gib
    seg_bytes = host_segment_bytes(config, mc, dtype, segment_pages)
    return min(int(host_gib * 2**30 // seg_bytes), full_length_segments(config, mc, max_model_len, segment_pages))


def host_segment_bytes(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, segment_pages: int) -> int:
    """Bytes of one host tier segment of ``segment_pages`` pages, in ``host_dtype``."""
    return HostTier.bytes_per_segment(segment_pages, config.cache.page_size, mc.head_dim, host_dtype(config, dtype))


def host_tier_bytes(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int,
                    segment_pages: int) -> int:
    """Bytes of the host tier's one allocation (``HostTier.nbytes``): the memory plan's figure."""
    return host_tier_segments(config, mc, dtype, max_model_len, segment_pages) * host_segment_bytes(
        config, mc, dtype, segment_pages)


def full_length_segments(config: SpinConfig, mc: ModelConfig, max_model_len: int, segment_pages: int = 1) -> int:
    """Segments of ``segment_pages`` pages (1: pages) that every request row (scheduler.max_num_seqs)
    holds at ``max_model_len`` tokens, in every layer and KV head."""
    max_pages = -(-max_model_len // config.cache.page_size)
    return config.scheduler.max_num_seqs * -(-max_pages // segment_pages) * mc.num_layers * mc.num_kv_heads


def full_length_bytes(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int,
                      segment_pages: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of every page of scheduler.max_num_seqs requests at ``max_model_len``
    tokens, in every layer and KV head: GPU pages in ``dtype``, host segments of ``segment_pages``
    pages in ``host_dtype``. As cache.kv_cache_gib and cache.host_kv_gib they hold a whole batch
    at full length in either tier, instead of the machine-wide defaults (the accuracy eval's
    engines)."""
    gpu = full_length_segments(config, mc, max_model_len) * PagePool.bytes_per_page(config.cache.page_size,
                                                                                      mc.head_dim, dtype)
    host = full_length_segments(config, mc, max_model_len, segment_pages) * host_segment_bytes(
        config, mc, dtype, segment_pages)
    return gpu, host
