"""Attention over the offloaded cache: the Spin data path, one layer at a time.

Per layer, for the decode requests of the step (all on the device, no host round trip)::

    Offload   new K/V -> their home pages (a GPU page in place; a host page on a side
              stream on CUDA); algorithm's Index updated
    Select    algorithm scores pages; top pages per head within budget + sink + local
    Retrieve  GPU home pages are read where they are; for host pages the buffer lookup:
              hits keep their slot, misses get LRU-evicted slots and one gather kernel
              copies their host pages in
    (write-through: the new token also goes into its tail page's slot)
    Attention paged decode over the selected slots, per-head lengths

Prefill chunks write their K/V to their home pages (born on the GPU while it has room, as
dense's) and attend with SDPA: the first chunk to itself, later chunks to the request's
earlier pages gathered from their homes. Pages whose home is the host also stay in the
request's GPU buffer share as far as it has room (``GpuBuffer.install``): they are on the
GPU already, and decode then starts warm.
The step plan is built once (``begin_step``) and read by every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spin_cluster.config import SparseConfig
from spin_cluster.dense_attention import decode_impl, prefill_attention
from spin_cluster.engine.backend import BackendParts
from spin_cluster.engine.cuda_graphs import PlannedCapture
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kernels import paged_decode
from spin_cluster.kvcache.buffer import InstallPlan
from spin_cluster.kvcache.offloaded import OffloadedKVManager
from spin_cluster.kvcache.transfer import Transfer
from spin_cluster.sparse import SelectPlan, SparseAlgorithm, select_layer
from spin_cluster.sparse.budget import PageBudget, budget_tokens_on_device, floor_tokens

if TYPE_CHECKING:
    from spin_cluster.sparse.prefill import BlockSparsePrefill


@dataclass(frozen=True)
class SpinPrefill:
    token_start: int
    num_tokens: int
    context_start: int
    # A later chunk's context, gathered from the host tier per layer into the same buffers:
    # per layer [Hkv * P'] int64 host pages of positions 0 .. context_start+n-1, and
    # [Hkv * P', S, D] K and V buffers (the layers run one after another on one stream)
    # that the host pages fill in order (dst_ids: 0 .. Hkv * P' - 1).
    host_pages: tuple[torch.Tensor, ...] = ()
    dst_ids: torch.Tensor | None = None
    k_ctx: torch.Tensor | None = None
    v_ctx: torch.Tensor | None = None
    # The chunk's pages to keep in the GPU buffer (they are on the GPU already), None: none.
    install: InstallPlan | None = None


@dataclass(frozen=True)
class SpinStepPlan:
    host_slots: tuple[torch.Tensor, ...]  # per layer [T * Hkv] flat host token slots, -1: a GPU home page
    append: object  # the algorithm's plan_append(token rows, positions), read by every layer
    num_decode: int  # Bd
    decode_rows: torch.Tensor | None  # [Bd]
    select: tuple[SelectPlan, ...] | None  # per layer (budgets may differ per layer)
    prefill: tuple[SpinPrefill, ...]
    # sparse.dense_layers: each decode row as a one-token chunk over its whole context,
    # gathered from the host tier in the dense layers (empty when there are none).
    dense_decode: tuple[SpinPrefill, ...] = ()
    # Per layer [T * Hkv] flat slots of the tokens whose pages live at home on the GPU, in the
    # GPU page array (-1: a host page); None without GPU home pages.
    gpu_slots: tuple[torch.Tensor, ...] | None = None


class SpinAttention(PlannedCapture):
    name = "spin"

    @classmethod
    def build(cls, kv: OffloadedKVManager, parts: BackendParts) -> SpinAttention:
        return cls(kv, parts.algorithm, parts.sparse, parts.max_model_len, parts.decode_attention, parts.prefill)

    def __init__(self, kv: OffloadedKVManager, algorithm: SparseAlgorithm, sparse: SparseConfig,
                 max_model_len: int, decode: str = "auto", prefill: BlockSparsePrefill | None = None) -> None:
        self.kv = kv
        self.sparse_prefill = prefill  # None: dense prefill
        self.algorithm = algorithm
        self.sparse = sparse
        self.max_model_len = max_model_len
        dev = kv.buffer.k_slots.device
        self.device = dev
        self._decode = decode_impl(decode, dev)
        self.transfer = Transfer(kv.homes, dev, kv.buffer, kv.directory)  # Offload and Retrieve
        if sparse.dense_layers > kv.num_layers:
            raise ValueError(f"sparse.dense_layers={sparse.dense_layers}: the model has {kv.num_layers} layers")
        self.dense_layers = 0 if algorithm.selects_all else sparse.dense_layers
        # Select's hysteresis (nats); read once, not per layer: only a buffer that keeps pages
        # between steps has held pages to favour.
        self.resident_margin = sparse.resident_margin if kv.buffer.reuse and not algorithm.selects_all else 0.0
        self.budget = PageBudget(sparse, kv.page_size, kv.num_kv_heads, algorithm.selects_all)
        self.plan: SpinStepPlan | None = None
        self.step_index = 0
        self.now = torch.zeros(1, dtype=torch.int32, device=dev)  # step_index on the device
        self._layer_budgets = self.budget.head_table(kv.num_layers, dev)  # [L, Hkv] pages, or None
        # Per-head budgets give a layer's heads rows of very different lengths (the widest
        # several times the mean): the Triton decode kernel then splits rows into equal
        # slices, so that the widest heads' programs are not the step's critical path
        # (``paged_decode.balanced_split_tokens``), one split length per (batch, width).
        self._balanced = (self._layer_budgets is not None and dev.type == "cuda"
                          and self._decode is paged_decode.paged_decode_attention)
        self._split_tokens: dict[tuple[int, int, int], int] = {}

    def row(self, request_id: str) -> int:
        return self.kv.row(request_id)

    # ---- per step ------------------------------------------------------------------------------

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        decode = [c for c in chunks if c.is_decode]
        bd = len(decode)
        pages = self.decode_pages(max(c.start for c in decode) + 1) if bd else 0
        dense_decode = tuple(self._prefill_plan(c, i) for i, c in enumerate(decode)) if self.dense_layers else ()
        prefill, start = [], bd
        for c in chunks[bd:]:
            install = self.kv.install_plan(c.request.request_id, c.start, c.num_tokens)
            prefill.append(dataclasses.replace(self._prefill_plan(c, start), install=install))
            start += c.num_tokens
        self.advance()
        self.plan = self.step_plan(positions, token_rows, bd, pages, tuple(prefill), dense_decode)

    def advance(self) -> None:
        """A new step: the buffer's LRU reads its index from the device (``now``)."""
        self.step_index += 1
        self.now.fill_(self.step_index)

    def decode_pages(self, context_tokens: int) -> int:
        """Pages a decode step scores and selects over when its longest request holds
        ``context_tokens``: its page count rounded up to an eighth of its power of two (at
        least 16), at most a request's page capacity. Select's shapes, and with them the
        compiled kernels and the CUDA graphs of decode steps, come in few sizes, for at most
        1/8 more pages scored (pages past a request's context are never selected)."""
        n = -(-context_tokens // self.kv.page_size)
        grain = max(16, (1 << max(0, (n - 1).bit_length())) // 8)
        return min(-(-n // grain) * grain, self.algorithm.max_pages_per_seq)

    def step_plan(self, positions: torch.Tensor, token_rows: torch.Tensor, num_decode: int, pages: int,
                  prefill: tuple[SpinPrefill, ...] = (), dense_decode: tuple[SpinPrefill, ...] = ()) -> SpinStepPlan:
        """The plan every layer reads, from the step's device tensors only (no host sync, no
        host->device copy), so that a CUDA graph of a decode step captures it with the model.
        The first ``num_decode`` tokens are decode tokens; ``pages`` is ``decode_pages``."""
        select = rows = None
        if num_decode:
            rows = token_rows[:num_decode]
            select = self._layer_select_plans(self._decode_select(positions[:num_decode], pages))
        # A decode step whose every layer runs a top-k Select (which may bring the index up to
        # date for the decode tokens itself: ``SparseAlgorithm.plan_append``).
        decode_only = (num_decode == positions.shape[0] and select is not None and select[0].top_p is None
                       and select[0].max_budget > 0)
        slots = self.kv.directory.token_slots(token_rows, positions).flatten(1)  # [L, T * Hkv]
        gpu_slots = None
        if self.transfer.gpu_homes:
            gpu, slots = self.kv.homes.split_token_slots(slots, self.kv.page_size)
            gpu_slots = gpu.unbind(0)
        return SpinStepPlan(
            gpu_slots=gpu_slots,
            host_slots=slots.unbind(0),
            append=self.algorithm.plan_append(token_rows, positions, decode_only=decode_only),
            num_decode=num_decode,
            decode_rows=rows,
            select=select,
            prefill=prefill,
            dense_decode=dense_decode,
        )

    def _decode_select(self, positions: torch.Tensor, pages: int) -> SelectPlan:
        """The step's Select plan from the decode tokens' positions [Bd] (context = position + 1)."""
        budget, S = self.budget, self.kv.page_size
        context = positions + 1  # [Bd]
        floor = floor_tokens(self.sparse)
        return SelectPlan(
            num_pages=positions // S + 1,
            tail_len=(positions % S + 1).int(),
            sink_pages=budget.sink_pages,
            local_pages=budget.local_pages,
            budget_pages=budget.pages(budget_tokens_on_device(self.sparse, context))[:, None].expand(
                -1, self.kv.num_kv_heads).contiguous(),
            max_pages=pages,
            max_budget=budget.max_middle_pages(pages * S),
            top_p=budget.top_p,
            dense_rows=context <= floor if floor else None,
        )

    def _layer_select_plans(self, sel: SelectPlan) -> tuple[SelectPlan, ...]:
        """One SelectPlan per layer: the step's, with the layer's per-head budgets if any (the
        step's own, every page, in rows at or under the budget floor)."""
        if self._layer_budgets is None:
            return (sel,) * self.kv.num_layers
        budgets = self._layer_budgets[:, None, :].expand(-1, *sel.budget_pages.shape)  # [L, Bd, Hkv]
        if sel.dense_rows is not None:
            budgets = torch.where(sel.dense_rows[None, :, None], sel.budget_pages[None], budgets)
        # One copy per step, so that no layer's Select copies its expanded view again.
        return tuple(dataclasses.replace(sel, budget_pages=b) for b in budgets.contiguous().unbind(0))

    def _prefill_plan(self, chunk: ScheduledChunk, token_start: int) -> SpinPrefill:
        if not chunk.start:
            return SpinPrefill(token_start, chunk.num_tokens, 0)
        kv, S = self.kv, self.kv.page_size
        num_pages = -(-(chunk.start + chunk.num_tokens) // S)
        pages = kv.directory.request_host_pages(chunk.request.request_id, num_pages)  # [L, Hkv, P']
        k = torch.empty(kv.num_kv_heads * num_pages, S, kv.buffer.k_slots.shape[-1],
                        dtype=kv.buffer.k_slots.dtype, device=self.device)
        dst = torch.arange(k.shape[0], device=self.device)
        return SpinPrefill(token_start, chunk.num_tokens, chunk.start, pages.flatten(1).unbind(0), dst, k,
                           torch.empty_like(k))

    @property
    def graph_safe(self) -> bool:
        """Whether a decode-only step can be captured in a CUDA graph: on CUDA, with an
        algorithm whose Index and Select are graph-safe, and no dense layers (those gather
        each request's whole context, a shape that grows every step)."""
        return self.device.type == "cuda" and self.algorithm.graph_safe and not self.dense_layers

    def padding_row(self) -> int | None:
        """The offloaded cache's padding row (``OffloadedKVManager.padding_row``)."""
        return self.kv.padding_row()

    def replayed(self) -> None:
        """A CUDA graph replayed a decode step (``SpinDecodeGraphs``): host bookkeeping that
        an eager step does in ``end_step``. Nothing here; a head-parallel rank reads its layer
        timings."""

    def end_step(self) -> None:
        self.plan = None
        self.transfer.wait_offload()

    # ---- per layer ----------------------------------------------------------------------------

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        if window is not None:
            raise ValueError("sliding-window layers (Gemma 3) need the paged KV cache; the spin "
                             "cache does not mask a window yet")
        plan = self.plan
        T, H, D = q.shape
        self.transfer.offload(plan.host_slots[layer_id], k.reshape(-1, D), v.reshape(-1, D),
                              None if plan.gpu_slots is None else plan.gpu_slots[layer_id])
        self.algorithm.append(layer_id, plan.append, k)
        out = torch.empty_like(q)  # [T, H, D]
        if plan.num_decode:
            bd = plan.num_decode
            self._decode_layer(layer_id, q[:bd], k[:bd], v[:bd], out[:bd])
        for seg in plan.prefill:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            if seg.install is not None and layer_id >= self.dense_layers:
                self._install(layer_id, seg.install, k[rows].reshape(-1, D), v[rows].reshape(-1, D))
            out[rows] = self._prefill(layer_id, seg, q[rows], k[rows], v[rows])
        return out

    def _install(self, layer: int, install: InstallPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill's pages stay in the GPU buffer as far as the share allows, so that decode
        does not start cold: k, v [n * Hkv, D] of the chunk's tokens, (token, head) order."""
        buf = self.kv.buffer
        self.transfer.write(buf.k_slots, buf.v_slots, k, v, buf.install(install, layer, self.now))

    def _decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """q [Bd, H, D]; k, v [Bd, Hkv, D] of the new tokens; writes out [Bd, H, D]."""
        plan, kv = self.plan, self.kv
        if layer < self.dense_layers:  # a dense layer: every row over its whole context
            for seg in plan.dense_decode:
                rows = slice(seg.token_start, seg.token_start + 1)
                k_ctx, v_ctx = self._gather_context(layer, seg)
                out[rows] = prefill_attention(q[rows], k_ctx, v_ctx, seg.context_start, None, layer)
            return
        sel, rows, buf = plan.select[layer], plan.decode_rows, kv.buffer
        margin = self.resident_margin
        held = self._resident(rows, layer, sel.max_pages) if margin else None
        want, num_selected = select_layer(self.algorithm, layer, q, rows, sel, held, margin)  # [Bd, Hkv, K]
        # No wait for this layer's host write: Retrieve may copy the tail page without the new
        # token, and its gather writes the token through over that copy, on this stream. Earlier
        # steps' writes have landed (end_step waits).
        D = q.shape[-1]
        slots, lens = self.transfer.retrieve(rows, layer, want, num_selected, sel.tail_len, self.now,
                                             k.reshape(-1, D), v.reshape(-1, D))
        kw = {"split_tokens": self._balanced_split(q.shape[0], slots.shape[-1], sel.max_pages)} if self._balanced else {}
        self._decode(q, buf.k_slots, buf.v_slots, slots, lens, out=out, **kw)

    def _balanced_split(self, batch: int, width: int, pages: int) -> int:
        """The decode kernel's split length for ``batch`` rows selecting up to ``width`` pages
        a head, at contexts of up to ``pages`` pages (a head's mean from its budgets)."""
        key = (batch, width, pages)
        if key not in self._split_tokens:
            S = self.kv.page_size
            mean = self.budget.mean_attended_pages(pages * S) * S
            sms = paged_decode.num_sms(self.device.index or 0)
            self._split_tokens[key] = paged_decode.balanced_split_tokens(
                batch, self.kv.num_kv_heads, mean, width * S, sms)
        return self._split_tokens[key]

    def _resident(self, rows: torch.Tensor, layer: int, num_pages: int) -> torch.Tensor:
        """[B, Hkv, num_pages] bool: pages a step reads without a transfer (at home on the GPU,
        or held by the buffer): Select's hysteresis leans towards them. No host sync."""
        return self.kv.buffer.resident(rows, layer, num_pages, self.transfer.home_map)

    def _prefill(self, layer: int, seg: SpinPrefill, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, H, D]; k, v [n, Hkv, D] -> [n, H, D]."""
        if seg.context_start == 0:
            return prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, self.sparse_prefill, layer)
        k_ctx, v_ctx = self._gather_context(layer, seg)
        return prefill_attention(q, k_ctx, v_ctx, seg.context_start, self.sparse_prefill, layer)

    def _gather_context(self, layer: int, seg: SpinPrefill) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's first context_start + n K/V of this layer from their homes: [Hkv, T, D]."""
        self.transfer.wait_offload()  # this chunk's own K/V reach the host on the side stream
        hkv, D = self.kv.num_kv_heads, seg.k_ctx.shape[-1]
        self.transfer.gather(seg.host_pages[layer], seg.k_ctx, seg.v_ctx, seg.dst_ids)
        num_tokens = seg.context_start + seg.num_tokens
        return seg.k_ctx.view(hkv, -1, D)[:, :num_tokens], seg.v_ctx.view(hkv, -1, D)[:, :num_tokens]
