"""Building the KV cache and its attention backend from the config: bytes into pages come from
``kvcache.sizing``, the pages a head selects from ``sparse.budget``.

The config names the cache (``cache_kind``); the cache kind's factory sizes and builds it;
the cache names its backend (``KVCache.attention_backend``), which ``backend_class`` finds::

    kind       cache.kind     cache (its backend)                 notes
    paged      paged          KVCacheManager (PagedAttention)     dense only; prefix caching
                                                                  with cache.enable_prefix_caching
                                                                  (off for sliding-window models)
    offloaded  offloaded      OffloadedKVManager (SpinAttention)  Spin: GPU home pages + host
                                                                  tier + GPU buffer, any
                                                                  registered sparse algorithm
    hybrid     offloaded, and HybridKVCache (HybridAttention)     sliding-window layers paged,
               the model has                                      the full-attention layers
               window layers                                      offloaded (Spin) as above

The offloaded cache's buffer follows cache.gpu_home_fraction and cache.buffer_share, and past
them a ``BufferPolicy`` (``kvcache.buffer_policy``: today's defaults unless a study sets one).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

import torch

from spin_cluster.algorithm_options import OPTIONS, SELECT_OPTIONS, AlgorithmOptions
from spin_cluster.config import SpinConfig
from spin_cluster.engine.backend import BackendParts, backend_class
from spin_cluster.kernels import cpu_native
from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy
from spin_cluster.kvcache.hybrid import HybridKVCache, LayerSplit
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.offloaded import OffloadedKVManager
from spin_cluster.kvcache.page_pool import PagePool
from spin_cluster.kvcache.sizing import (gpu_budget_bytes, gpu_page_slots, host_dtype, host_tier_segments,
                                         num_gpu_pages, split_gpu_pages, step_activation_bytes, window_gpu_pages)
from spin_cluster.kvcache.window import LayerWindows
from spin_cluster.models.config import ModelConfig
from spin_cluster.sparse import SparseAlgorithm, get_algorithm
from spin_cluster.sparse.budget import PageBudget, budget_tokens
from spin_cluster.sparse.prefill import BlockSparsePrefill

log = logging.getLogger(__name__)

# Most columns of one buffer share (the page -> column map holds int16 columns).
_MAX_SHARE = 2**15 - 1


def cache_kind(config: SpinConfig, mc: ModelConfig | None = None) -> str:
    """The name of the KV cache the config asks for (a key of ``CACHE_KINDS``) for the model
    ``mc`` (None: one without sliding-window layers): cache.kind, except that a model with
    sliding-window layers takes the hybrid cache where the config asks for the offloaded one."""
    if config.cache.kind == "paged":
        return "paged"
    return "hybrid" if mc is not None and any(w is not None for w in mc.layer_windows) else "offloaded"


def build_cache(config: SpinConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_model_len: int, decode_attention: str = "auto", policy: BufferPolicy = DEFAULT_POLICY):
    """Returns (kv manager, attention backend). ``policy``: the offloaded cache's buffer
    mechanisms (``BufferPolicy``; the paged cache has no buffer)."""
    algorithm_cls = check_cache_config(config, max_model_len)
    parts = BackendParts(config.sparse, max_model_len, decode_attention, prefill=_sparse_prefill(config, mc, device))
    kv, parts = CACHE_KINDS[cache_kind(config, mc)](config, mc, dtype, device, parts, algorithm_cls, policy)
    return kv, backend_class(kv.attention_backend).build(kv, parts)


def check_cache_config(config: SpinConfig, max_model_len: int) -> type[SparseAlgorithm]:
    """The sparse algorithm class, once the config's sparse section fits the cache and the
    context (``check_sparse_algorithm``, and a budget within the context). Cheap (no tensors),
    so that a server checks it before it starts anything."""
    algorithm_cls = check_sparse_algorithm(config)
    budget = budget_tokens(config.sparse, max_model_len)
    if not algorithm_cls.selects_all and config.sparse.per_head_budgets is None and budget > max_model_len:
        raise ValueError(
            f"sparse.budget={config.sparse.budget} tokens is larger than the context "
            f"(max_model_len={max_model_len}); lower it or give a fraction in (0, 1)"
        )
    return algorithm_cls


def check_sparse_algorithm(config: SpinConfig) -> type[SparseAlgorithm]:
    """The class of ``sparse.algorithm``: a registered name, with options its constructors
    take, on the offloaded cache unless it is dense. Needs no model."""
    try:
        algorithm_cls = get_algorithm(config.sparse.algorithm)
    except ValueError as e:
        raise ValueError(f"sparse.algorithm: {e}") from None
    if config.cache.kind == "paged" and algorithm_cls.name != "dense":
        raise ValueError(
            f"sparse.algorithm={algorithm_cls.name!r} runs on the offloaded cache: set cache.kind=offloaded"
        )
    if config.sparse.algorithm not in OPTIONS:  # one registered outside the table: its own model, now known
        config.sparse.typed_options(getattr(algorithm_cls, "options_model", AlgorithmOptions))
    return algorithm_cls


def paged_kv_dtype(config: SpinConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The paged cache's page dtype for a model running in ``dtype`` on ``device``
    (``cache.kv_cache_dtype``; null: float16 on a CPU whose native decode kernel reads float16
    pages, when the model runs in float32, else ``dtype``)."""
    choice = config.cache.kv_cache_dtype
    if choice is None:
        half = device.type == "cpu" and dtype == torch.float32 and cpu_native.kv_float16()
        return torch.float16 if half else dtype
    if choice == "auto":
        return dtype
    pages = getattr(torch, choice)
    if pages != dtype and device.type != "cpu":
        raise ValueError(f"cache.kv_cache_dtype={choice!r} with a {str(dtype).removeprefix('torch.')} model: on a "
                         f"GPU the pages take the model's dtype (auto)")
    return pages


def _build_paged(config, mc, dtype, device, parts: BackendParts, algorithm_cls, policy: BufferPolicy):
    dtype = paged_kv_dtype(config, dtype, device)
    kv = KVCacheManager(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        page_size=config.cache.page_size, num_pages=num_gpu_pages(config, mc, dtype, device, parts.max_model_len),
        max_seqs=config.scheduler.max_num_seqs, max_model_len=parts.max_model_len, dtype=dtype, device=device,
        enable_prefix_caching=_prefix_caching(config, mc), layer_windows=mc.layer_windows,
    )
    return kv, parts


def _prefix_caching(config: SpinConfig, mc: ModelConfig) -> bool:
    """``cache.enable_prefix_caching``, except for a model with sliding-window layers: the
    cache frees their pages behind the window, so no request's full pages stay whole to share."""
    if config.cache.enable_prefix_caching and any(w is not None for w in mc.layer_windows):
        log.info("prefix caching is off: the model's sliding-window layers keep only their window's pages")
        return False
    return config.cache.enable_prefix_caching


def _build_offloaded(config, mc, dtype, device, parts: BackendParts, algorithm_cls, policy: BufferPolicy,
                     model_layers: tuple[int, ...] | None = None):
    """``model_layers``: the model's layer id of each of ``mc.num_layers`` layers (the hybrid
    cache's global layers); None: all of them."""
    max_model_len = parts.max_model_len
    cc, sc, S = config.cache, config.scheduler, config.cache.page_size
    max_pages = -(-max_model_len // S)
    shape = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, page_size=S,
                 max_seqs=sc.max_num_seqs, max_pages_per_seq=max_pages, device=device, model_layers=model_layers)
    # A paged index is built once the cache knows how many pages it holds (below); until
    # then an empty one tells its bytes per page.
    paged = algorithm_cls.paged_index
    algorithm = _make_algorithm(algorithm_cls, config, **shape, **({"index_pages": 0} if paged else {}))
    budget = PageBudget(config.sparse, S, mc.num_kv_heads, algorithm.selects_all)
    mandatory = min(max_pages, budget.mandatory_pages(max_model_len))
    # Without reuse a page never outlives its step: columns past the mandatory ones are idle.
    # buffer_share 0: no cap below the request's pages (the share grows while slots are free).
    multiple = (cc.buffer_share or max_pages / mandatory) if policy.reuse else 1
    share = policy.pages_per_head or min(max_pages, math.ceil(multiple * mandatory))
    if share > _MAX_SHARE:
        raise ValueError(f"a GPU buffer share of {share} pages per head is over {_MAX_SHARE} (the page -> "
                         f"column map is 16-bit): raise cache.page_size or set cache.buffer_share")
    slot_bytes = PagePool.bytes_per_page(S, mc.head_dim, dtype)
    index_page_bytes = algorithm.index_bytes_held_per_token() * S  # one logical page, every layer and head
    held = index_page_bytes * algorithm.num_index_pages  # a paged index's probe holds none
    gpu_bytes = gpu_budget_bytes(config, device, step_activation_bytes(config, mc, dtype, max_model_len), held) - held
    per_column = mc.num_layers * mc.num_kv_heads
    widths = head_mandatory = None
    # Per-head widths need each head's own selection bounded by its budget: top-k over
    # per-head budgets (top-p lets a head take a layer's whole budget).
    sp = config.sparse
    if (policy.per_head_shares and not policy.pages_per_head and sp.per_head_budgets is not None
            and sp.top_p is None and not algorithm.selects_all):
        head_mandatory = budget.head_mandatory_pages(mc.num_layers, max_pages)
        widths = [[min(max_pages, math.ceil(multiple * m)) for m in row] for row in head_mandatory]
        share = max(max(row) for row in widths)
    full_slots = sum(map(sum, widths)) if widths else share * per_column
    least_slots = sum(map(sum, head_mandatory)) if head_mandatory else mandatory * per_column
    E = policy.segment_pages
    num_host_segments = host_tier_segments(config, mc, dtype, max_model_len, E)
    index_per_slot = index_page_bytes / per_column if paged else 0.0
    all_slots = gpu_page_slots(gpu_bytes, slot_bytes, index_per_slot, num_host_segments * E)
    num_slots, num_gpu_segments = split_gpu_pages(config, all_slots, least_slots, max_pages, per_column, E)
    num_slots = min(num_slots, sc.max_num_seqs * full_slots)
    if num_slots < least_slots:
        raise ValueError(
            f"the GPU buffer ({num_slots} page slots) cannot hold one request's selected pages "
            f"({least_slots} over {per_column} heads); give the KV cache more memory (cache.kv_cache_gib, or "
            "cache.gpu_memory_utilization where that is null), lower sparse.budget or lower cache.gpu_home_fraction"
        )
    if num_host_segments == 0 and num_gpu_segments == 0:
        raise ValueError("cache.host_kv_gib=0 leaves no page a home: give the GPU home pages "
                         "(cache.gpu_home_fraction > 0) or the host tier some GiB")
    kv = OffloadedKVManager(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, page_size=S,
        segment_pages=E, num_gpu_segments=num_gpu_segments, host_dtype=host_dtype(config, dtype),
        num_host_segments=num_host_segments,
        num_buffer_slots=num_slots, buffer_pages_per_head=share, mandatory_pages_per_head=mandatory,
        max_seqs=sc.max_num_seqs, max_model_len=max_model_len, dtype=dtype, device=device,
        elastic_shares=policy.elastic_shares, reuse=policy.reuse,
        head_widths=widths, head_mandatory=head_mandatory,
    )
    if paged:
        algorithm = _make_algorithm(algorithm_cls, config, **shape, index_pages=kv.directory.num_logical_segments * E)
        algorithm.bind_pages(kv.directory.logical_ids, E)
    return kv, dataclasses.replace(parts, algorithm=algorithm)


def _build_hybrid(config, mc, dtype, device, parts: BackendParts, algorithm_cls, policy: BufferPolicy):
    """The window layers' paged cache first, sized for every request row's windows at full
    length (at most half the GPU KV memory: ``sizing.window_gpu_pages``), then the Spin cache of
    the global layers in the rest: the algorithm, its index, the buffer and the home pages
    sized for those layers only, and per-head budgets their rows of ``sparse.options.per_head_budgets``."""
    split = LayerSplit.of(mc.layer_windows)
    if not split.global_layers:
        raise ValueError("every layer of this model has a sliding window: Spin has nothing to serve; "
                         "set cache.kind=paged")
    S, max_model_len = config.cache.page_size, parts.max_model_len
    window_of = tuple(mc.layer_windows[layer] for layer in split.window_layers)
    windows = LayerWindows.of(window_of, len(window_of), S)
    page_bytes = PagePool.bytes_per_page(S, mc.head_dim, dtype)
    gpu_bytes = gpu_budget_bytes(config, device, step_activation_bytes(config, mc, dtype, max_model_len))
    num_pages = window_gpu_pages(config, windows, mc.num_kv_heads, page_bytes, gpu_bytes, max_model_len)
    paged = KVCacheManager(
        num_layers=len(window_of), num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, page_size=S,
        num_pages=num_pages, max_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len, dtype=dtype,
        device=device, layer_windows=window_of,
    )
    rows = config.sparse.per_head_budgets
    sparse = {} if rows is None else {"options": {**config.sparse.options,
                                                  "per_head_budgets": [rows[layer] for layer in split.global_layers]}}
    # A GPU given no size: the Spin part measures what is free once the paged pages (and its
    # algorithm's index) are allocated, as the offloaded cache does; else the size's rest.
    rest_gib = (gpu_bytes - num_pages * page_bytes) / 2**30
    given = config.cache.kv_cache_gib is not None or device.type != "cuda"
    spin_config = config.replace(cache={"kv_cache_gib": rest_gib} if given else {}, sparse=sparse)
    spin_mc = dataclasses.replace(mc, num_layers=len(split.global_layers), layer_windows=())
    spin, parts = _build_offloaded(spin_config, spin_mc, dtype, device,
                                   dataclasses.replace(parts, sparse=spin_config.sparse), algorithm_cls, policy,
                                   model_layers=split.global_layers)
    return HybridKVCache(split, paged, spin), parts


# A cache kind's factory: (config, model shape, dtype, device, parts, algorithm class, buffer
# policy) -> (the cache, the parts its backend is built from).
CACHE_KINDS = {"paged": _build_paged, "offloaded": _build_offloaded, "hybrid": _build_hybrid}


def _sparse_prefill(config: SpinConfig, mc: ModelConfig, device: torch.device) -> BlockSparsePrefill | None:
    """Block-sparse prefill of ``sparse.prefill``; None: dense. Either cache takes it: prefill
    still writes every token's K/V, so decode and the memory system see the same cache."""
    if config.sparse.prefill.algorithm == "dense":
        return None
    return BlockSparsePrefill(config.sparse.prefill.typed_options(), mc.num_layers, mc.num_kv_heads, device)


def _make_algorithm(cls, config: SpinConfig, **shape):
    # Select's own options (top_p) are the system's, not the algorithm's constructor's.
    options = {k: v for k, v in (config.sparse.options or {}).items() if k not in SELECT_OPTIONS}
    accepted = inspect.signature(cls.__init__).parameters
    if "model_path" in accepted:  # lets an algorithm check a trained file against the model
        options.setdefault("model_path", config.model.resolved_path())
    try:
        return cls(**shape, **options)
    except TypeError as e:
        raise ValueError(f"sparse.options {sorted(options)} do not fit algorithm {cls.name!r}: {e}") from None
