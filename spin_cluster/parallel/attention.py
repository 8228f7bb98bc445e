"""One rank's attention backends. ``HeadParallelAttention`` (the GPU-only paged cache): its KV
heads of every layer as columns of one paged cache. ``HeadParallelSpinAttention`` (the
offloaded Spin cache): every layer padded to one width of head columns (see there).

A rank owns a different number of KV heads in each layer (possibly none), so its cache is
not [L, Hkv]-shaped. It is built as a one-layer paged cache whose C "heads" are the rank's
(layer, KV head) pairs in order, and each layer reads its own run of columns::

    columns:  | layer 0: heads a, b | layer 1: head c | layer 2: (none) | layer 3: d, e, f |
              0                     2                 3                 3                  6

The wrapped ``PagedAttention`` plans the step once over all C columns; ``begin_step`` slices
that plan into one plan per layer, and ``forward`` hands layer l's plan to the wrapped backend
as its layer 0. Pages are therefore allocated only for heads the rank owns. Each layer's
attention is timed, and ``end_step`` gathers every rank's times for the bubble statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.backend import AttentionBackend
from spin_cluster.engine.cuda_graphs import PlannedCapture
from spin_cluster.engine.paged_attention import PagedAttention, StepPlan
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.kernels import paged_decode_cpu
from spin_cluster.kvcache.page_pool import PagePool
from spin_cluster.kvcache.sizing import gpu_budget_bytes, num_gpu_pages, step_activation_bytes
from spin_cluster.models import ModelConfig
from spin_cluster.parallel.group import all_gather_floats, all_reduce_min
from spin_cluster.parallel.timing import LayerTimer


class _RankBackend(AttentionBackend):
    """What both rank backends share: the wrapped backend's step, the per-layer timing of this
    rank's attention, and the all-gather of every rank's times at the end of the step.
    Subclasses attend in ``_attend``; a layer where the rank owns no head is skipped."""

    @classmethod
    def rank_cache(cls, config: SpinConfig, mc: ModelConfig, placement: HeadPlacement, rank: int, dtype: torch.dtype,
                   device: torch.device, max_model_len: int, group=None) -> tuple[SpinConfig, ModelConfig]:
        """The config and model shape rank ``rank``'s own cache is built from
        (``build_cache``), of the same capacity on every rank (a collective over ``group``)."""
        raise NotImplementedError

    @classmethod
    def over(cls, inner, kv_heads: Sequence[Sequence[int]], mc: ModelConfig, group=None) -> _RankBackend:
        """This wrapper around ``inner``, the backend built over ``rank_cache``'s cache."""
        raise NotImplementedError

    def __init__(self, inner, num_layers: int, group=None) -> None:
        self.inner = inner
        self.group = group
        self.timer = LayerTimer(num_layers, inner.device)
        self._rank_layer_s: list[list[float]] | None = None

    def row(self, request_id: str) -> int:
        return self.inner.row(request_id)

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        self.inner.begin_step(chunks, positions, token_rows)
        self._after_begin()
        self.timer.reset()

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        # q: [T, H_r, D], k/v: [T, Hkv_r, D] for this rank's heads of the layer -> [T, H_r, D]
        if window is not None:
            raise ValueError("sliding-window layers (Gemma 3) do not run head-parallel yet; use one rank")
        if k.shape[1] == 0:
            return torch.empty_like(q)
        self.timer.start(layer_id)
        out = self._attend(layer_id, q, k, v)
        self.timer.stop(layer_id)
        return out

    def end_step(self) -> None:
        self.inner.end_step()
        self._after_end()
        capturing = self.inner.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a capture runs nothing to time
            self._gather_times()

    def _gather_times(self) -> None:
        """Every rank's layer times of this step (a collective: every rank calls it)."""
        self._rank_layer_s = all_gather_floats(self.timer.read(), self.group)

    def pop_rank_layer_s(self) -> list[list[float]] | None:
        """[R][L] attention seconds of every rank in the last step, once (None after that)."""
        times, self._rank_layer_s = self._rank_layer_s, None
        return times

    def _after_begin(self) -> None:
        pass

    def _after_end(self) -> None:
        pass

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class HeadParallelAttention(_RankBackend):
    @classmethod
    def rank_cache(cls, config, mc, placement, rank, dtype, device, max_model_len, group=None):
        """A one-layer paged cache with one column per owned (layer, KV head), holding the
        same number of token pages as every other rank's (the smallest)."""
        columns = sum(len(h) for h in placement.kv_heads_of(rank))
        rank_mc = dataclasses.replace(mc, num_layers=1, num_kv_heads=columns)
        pages = num_gpu_pages(config, rank_mc, dtype, device, max_model_len)
        token_pages = all_reduce_min(pages // columns, group)
        page_bytes = PagePool.bytes_per_page(config.cache.page_size, rank_mc.head_dim, dtype)
        # An exact binary fraction: the builder gets back exactly token_pages * columns pages.
        gib = token_pages * columns * page_bytes / 2**30
        return config.replace(cache={"kv_cache_gib": gib}), rank_mc

    @classmethod
    def over(cls, inner, kv_heads, mc, group=None):
        return cls(inner, kv_heads, group)

    def __init__(self, inner: PagedAttention, kv_heads: Sequence[Sequence[int]], group=None) -> None:
        starts = [0]
        for heads in kv_heads:
            starts.append(starts[-1] + len(heads))
        if starts[-1] != inner.kv.num_kv_heads or inner.kv.num_layers != 1:
            raise ValueError(f"the cache must be one layer of {starts[-1]} head columns")
        super().__init__(inner, len(kv_heads), group)
        self._columns = [slice(a, b) for a, b in zip(starts, starts[1:])]  # [L]
        self._layer_plans: list[StepPlan] | None = None

    def _after_begin(self) -> None:
        self._layer_plans = [_columns_plan(self.inner, cols) for cols in self._columns]

    def _attend(self, layer_id, q, k, v):
        self.inner.plan = self._layer_plans[layer_id]
        return self.inner.forward(0, q, k, v)

    def _after_end(self) -> None:
        self._layer_plans = None


def _columns_plan(inner: PagedAttention, cols: slice) -> StepPlan:
    """The step plan of one layer: its columns of the one-layer plan, contiguous. The CPU's
    gather plan is built again over those columns (the one over all C columns would gather
    every layer's heads); a layer without columns is never attended."""
    plan = inner.plan
    tables = plan.decode_block_tables
    layer_tables = None if tables is None else tables[0][:, cols].contiguous()  # [Bd, n, P]
    gathered = None
    if plan.gathered is not None and layer_tables.shape[1]:
        gathered = paged_decode_cpu.plan_gathered_decode(layer_tables[:, None], plan.decode_seq_lens, inner.pool.k_pages)
    return dataclasses.replace(
        plan,
        slot_mapping=(plan.slot_mapping[0][:, cols].contiguous(),),  # [T, n]
        decode_block_tables=None if tables is None else (layer_tables,),
        prefill=tuple(dataclasses.replace(s, pages=s.pages and (s.pages[0][cols].contiguous(),)) for s in plan.prefill),
        gathered=gathered,
    )


class HeadParallelSpinAttention(_RankBackend, PlannedCapture):
    """One rank's Spin backend (the offloaded cache): ``W`` KV-head columns in every layer,
    ``W`` the most heads any rank owns in any layer.

    The offloaded cache (host tier, GPU buffer shares, the algorithm's index) is [L, Hkv]
    shaped throughout, so a rank's uneven heads per layer are padded instead of packed::

        layer l, rank r owns n_l heads:  columns | h_a h_b .. (n_l) | padding (W - n_l) |

    Padding columns get zero K/V and zero queries, and their output is dropped. With
    ``sparse.options.per_head_budgets`` their budget is 0 (they read only their sink and local
    pages); with a uniform budget they select like any head (wasted, bounded work). ``W`` is
    the same on every rank, so every rank's cache has the same shape and capacity: rank 0's
    cache calls (its step plans) fit every worker's cache. Selection is per KV head, so a head
    selects the same pages on any rank.

    Decode-only steps run in the wrapped backend's CUDA graphs (``SpinDecodeGraphs``), each
    layer's o_proj all-reduce inside the graph and the layer timer's events as event nodes,
    so a rank's attention time is its GPU time, free of launch gaps.
    """

    capture_error_mode = "thread_local"  # the NCCL watchdog thread polls events meanwhile

    @classmethod
    def rank_cache(cls, config, mc, placement, rank, dtype, device, max_model_len, group=None):
        """The offloaded cache over W padded head columns per layer, the same shape and size
        on every rank."""
        width = max(len(heads) for r in range(placement.num_ranks) for heads in placement.kv_heads_of(r))
        kv_heads = placement.kv_heads_of(rank)
        rank_mc = dataclasses.replace(mc, num_kv_heads=width, num_heads=width * mc.num_kv_groups)
        sparse = {}
        if config.sparse.per_head_budgets is not None:
            rows = config.sparse.per_head_budgets
            sparse["options"] = {**config.sparse.options, "per_head_budgets": [
                [rows[layer][h] for h in heads] + [0] * (width - len(heads)) for layer, heads in enumerate(kv_heads)]}
        activation_bytes = step_activation_bytes(config, rank_mc, dtype, max_model_len)
        gpu_bytes = all_reduce_min(int(gpu_budget_bytes(config, device, activation_bytes)), group)
        return config.replace(cache={"kv_cache_gib": gpu_bytes / 2**30}, sparse=sparse), rank_mc

    @classmethod
    def over(cls, inner, kv_heads, mc, group=None):
        return cls(inner, kv_heads, inner.kv.num_kv_heads, mc.num_kv_groups, group)

    def __init__(self, inner, kv_heads: Sequence[Sequence[int]], width: int, num_kv_groups: int, group=None) -> None:
        if inner.kv.num_kv_heads != width or inner.kv.num_layers != len(kv_heads):
            raise ValueError(f"the cache must have {len(kv_heads)} layers of {width} head columns")
        if any(len(heads) > width for heads in kv_heads):
            raise ValueError(f"a layer owns more than {width} KV heads")
        super().__init__(inner, len(kv_heads), group)
        self.width, self.num_kv_groups = width, num_kv_groups
        self._owned_layers = [layer for layer, heads in enumerate(kv_heads) if heads]

    # What SpinDecodeGraphs reads of a SpinAttention, from the wrapped one.
    @property
    def graph_safe(self) -> bool:
        return self.inner.graph_safe

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def plan(self):
        return self.inner.plan

    @plan.setter
    def plan(self, plan) -> None:
        self.inner.plan = plan

    def advance(self) -> None:
        self.inner.advance()

    def decode_pages(self, context_tokens: int) -> int:
        return self.inner.decode_pages(context_tokens)

    def step_plan(self, *args, **kw):
        self.timer.reset()
        return self.inner.step_plan(*args, **kw)

    def replayed(self) -> None:
        self.inner.replayed()
        self.timer.replayed(self._owned_layers)
        self._gather_times()

    def _attend(self, layer_id, q, k, v):
        n = k.shape[1]
        pad = self.width - n
        if pad:
            q = torch.nn.functional.pad(q, (0, 0, 0, pad * self.num_kv_groups))
            k = torch.nn.functional.pad(k, (0, 0, 0, pad))
            v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        out = self.inner.forward(layer_id, q, k, v)
        return out[:, : n * self.num_kv_groups] if pad else out


# The head-parallel wrapper of each cache kind (``cache_builder.cache_kind``).
RANK_BACKENDS: dict[str, type[_RankBackend]] = {"paged": HeadParallelAttention, "offloaded": HeadParallelSpinAttention}
