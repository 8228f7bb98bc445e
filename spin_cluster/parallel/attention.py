"""One rank's attention backend: its KV heads of every layer as columns of one paged cache.

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

from spin_cluster.engine.paged_attention import PagedAttention, StepPlan
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.parallel.group import all_gather_floats
from spin_cluster.parallel.timing import LayerTimer


class HeadParallelAttention:
    def __init__(self, inner: PagedAttention, kv_heads: Sequence[Sequence[int]], group=None) -> None:
        self.inner = inner
        self.group = group
        starts = [0]
        for heads in kv_heads:
            starts.append(starts[-1] + len(heads))
        if starts[-1] != inner.kv.num_kv_heads or inner.kv.num_layers != 1:
            raise ValueError(f"the cache must be one layer of {starts[-1]} head columns")
        self._columns = [slice(a, b) for a, b in zip(starts, starts[1:])]  # [L]
        self._layer_plans: list[StepPlan] | None = None
        self.timer = LayerTimer(len(self._columns), inner.device)
        self._rank_layer_s: list[list[float]] | None = None

    def row(self, request_id: str) -> int:
        return self.inner.row(request_id)

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        self.inner.begin_step(chunks, positions, token_rows)
        plan = self.inner.plan
        self._layer_plans = [_columns_plan(plan, cols) for cols in self._columns]
        self.timer.reset()

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H_r, D], k/v: [T, Hkv_r, D] for this rank's heads of the layer -> [T, H_r, D]
        if k.shape[1] == 0:
            return torch.empty_like(q)
        self.timer.start(layer_id)
        self.inner.plan = self._layer_plans[layer_id]
        out = self.inner.forward(0, q, k, v)
        self.timer.stop(layer_id)
        return out

    def end_step(self) -> None:
        self.inner.end_step()
        self._layer_plans = None
        self._rank_layer_s = all_gather_floats(self.timer.read(), self.group)

    def pop_rank_layer_s(self) -> list[list[float]] | None:
        """[R][L] attention seconds of every rank in the last step, once (None after that)."""
        times, self._rank_layer_s = self._rank_layer_s, None
        return times


def _columns_plan(plan: StepPlan, cols: slice) -> StepPlan:
    """The step plan of one layer: its columns of the one-layer plan, contiguous."""
    tables = plan.decode_block_tables
    return dataclasses.replace(
        plan,
        slot_mapping=(plan.slot_mapping[0][:, cols].contiguous(),),  # [T, n]
        decode_block_tables=None if tables is None else (tables[0][:, cols].contiguous(),),  # [Bd, n, P]
        prefill=tuple(dataclasses.replace(s, pages=s.pages and (s.pages[0][cols].contiguous(),)) for s in plan.prefill),
    )
