"""Attention over the hybrid cache (``kvcache/hybrid.py``): sliding-window layers paged and
dense over their window, full-attention layers through Spin.

The backend owns one backend per part and sends each model layer to its part's backend
under that part's layer index (``LayerSplit.part_of``)::

    forward(layer, q, k, v, window)
        window layer  -> PagedAttention.forward(its paged index, ..., window)
        global layer  -> SpinAttention.forward(its Spin index, ...)

Both plan every step (``begin_step``, with the paged part's rows looked up from the Spin
rows the runner gives) and both end it. The sparse algorithm, per-head budgets, dense
layers and block-sparse prefill are the Spin part's, over the global layers only; window
layers prefill densely (block-sparse prefill does not mask a window).

Decode steps are captured in CUDA graphs as the Spin backend's are (``PlannedCapture``:
one graph per batch size and Select width, the plan built inside the graph from the step's
device tensors): the Spin part builds its plan as it does alone, and the paged part builds
its window layers' plan from the same positions and its own rows (``PagedAttention.
decode_plan``: slots, and per window the pages it can touch, all on the device). The paged
part's own padded capture is not used here; with a Spin part in the step, no row may be
padding (a padding row would touch a real row's buffer shares).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spin_cluster.engine.backend import BackendParts
from spin_cluster.engine.cuda_graphs import PlannedCapture
from spin_cluster.engine.paged_attention import PagedAttention, StepPlan
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.engine.spin_attention import SpinAttention, SpinStepPlan
from spin_cluster.kvcache.hybrid import HybridKVCache


class HybridPlan(NamedTuple):
    """A step's plan: each part's own."""

    spin: SpinStepPlan
    paged: StepPlan


class SpinLayerPrefill:
    """Block-sparse prefill of the model's layers, called with the Spin part's layer indices:
    its budgets and profiles are per model layer (``sparse.prefill``)."""

    def __init__(self, inner, global_layers: tuple[int, ...]) -> None:
        self.inner = inner
        self.global_layers = global_layers  # Spin layer index -> model layer id

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 context_start: int) -> torch.Tensor:
        return self.inner(self.global_layers[layer], q, k, v, context_start)

    def density(self) -> float:
        return self.inner.density()


class HybridAttention(PlannedCapture):
    name = "hybrid"

    @classmethod
    def build(cls, kv: HybridKVCache, parts: BackendParts) -> HybridAttention:
        prefill = None if parts.prefill is None else SpinLayerPrefill(parts.prefill, kv.split.global_layers)
        spin = SpinAttention(kv.spin, parts.algorithm, parts.sparse, parts.max_model_len, parts.decode_attention,
                             prefill)
        return cls(kv, PagedAttention(kv.paged, parts.decode_attention), spin)

    def __init__(self, kv: HybridKVCache, paged: PagedAttention, spin: SpinAttention) -> None:
        self.kv = kv
        self.paged = paged
        self.spin = spin
        self.device = spin.device
        self._part_of = kv.split.part_of()  # [L] (window layer?, index in its part)

    @property
    def plan(self) -> HybridPlan | None:
        return None if self.spin.plan is None else HybridPlan(self.spin.plan, self.paged.plan)

    @plan.setter
    def plan(self, plan: HybridPlan | None) -> None:
        self.spin.plan, self.paged.plan = (None, None) if plan is None else plan

    @property
    def algorithm(self):
        return self.spin.algorithm

    @property
    def sparse_prefill(self):
        return self.spin.sparse_prefill

    def row(self, request_id: str) -> int:
        return self.kv.row(request_id)

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        self.spin.begin_step(chunks, positions, token_rows)
        self.paged.begin_step(chunks, positions, self.kv.paged_rows(token_rows))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        is_window, index = self._part_of[layer_id]
        if is_window != (window is not None):
            raise ValueError(f"layer {layer_id} was split as {'a window' if is_window else 'a global'} layer "
                             f"but runs with window={window}")
        if is_window:
            return self.paged.forward(index, q, k, v, window)
        return self.spin.forward(index, q, k, v)

    # ---- CUDA graphs of decode steps (``PlannedCapture``) -----------------------------------

    @property
    def graph_safe(self) -> bool:
        return self.spin.graph_safe

    @property
    def capture_error_mode(self) -> str:
        return self.spin.capture_error_mode

    def advance(self) -> None:
        self.spin.advance()

    def decode_pages(self, context_tokens: int) -> int:
        return self.spin.decode_pages(context_tokens)

    def step_plan(self, positions: torch.Tensor, token_rows: torch.Tensor, num_decode: int,
                  pages: int) -> HybridPlan:
        """A decode-only step's plans from device tensors only: token_rows are Spin rows."""
        return HybridPlan(self.spin.step_plan(positions, token_rows, num_decode, pages),
                          self.paged.decode_plan(positions, self.kv.paged_rows(token_rows)))

    def replayed(self) -> None:
        self.spin.replayed()

    def end_step(self) -> None:
        try:
            self.spin.end_step()
        finally:
            self.paged.end_step()
