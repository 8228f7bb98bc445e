"""Attention over the offloaded cache: the Spin data path, one layer at a time.

Per layer, for the decode requests of the step (all on the device, no host round trip)::

    Offload   new K/V -> their host pages (side stream on CUDA); algorithm's Index updated
    Select    algorithm scores pages; top pages per head within budget + sink + local
    Retrieve  buffer lookup: hits keep their slot, misses get LRU-evicted slots and one
              gather kernel copies their host pages in
    (write-through: the new token also goes into its tail page's slot)
    Attention paged decode over the selected slots, per-head lengths

Prefill chunks write their K/V to the host pages and attend with SDPA: the first chunk to
itself, later chunks to the request's earlier pages gathered from the host tier.
The step plan is built once (``begin_step``) and read by every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spin_cluster.config import SparseConfig
from spin_cluster.engine.paged_attention import decode_impl, prefill_attention
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kernels import offload, retrieve
from spin_cluster.kvcache.offloaded import OffloadedKVManager
from spin_cluster.partition import SelectPlan, SparseAlgorithm, select_pages

if TYPE_CHECKING:
    from spin_cluster.sparse.prefill import BlockSparsePrefill


@dataclass(frozen=True)
class SpinPrefill:
    token_start: int
    num_tokens: int
    context_start: int
    request_id: str


@dataclass(frozen=True)
class SpinStepPlan:
    host_slots: torch.Tensor  # [L, T, Hkv] flat host token slots
    token_rows: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    num_decode: int  # Bd
    decode_rows: torch.Tensor | None  # [Bd]
    select: SelectPlan | None
    prefill: tuple[SpinPrefill, ...]


class SpinAttention:
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
        on_cuda = dev.type == "cuda"
        self._write = offload.write_tokens if on_cuda else offload.write_tokens_ref
        self._retrieve = retrieve.retrieve_pages if on_cuda else retrieve.retrieve_pages_ref
        self._side = torch.cuda.Stream(dev) if on_cuda else None
        S = kv.page_size
        self.sink_pages = -(-sparse.sink_tokens // S)
        self.local_pages = max(1, -(-sparse.local_tokens // S))  # the tail page is always local
        self.plan: SpinStepPlan | None = None
        self.step_index = 0
        self._layer_budgets = None  # [L, Hkv] pages
        if sparse.per_head_budgets is not None:
            table = torch.tensor(sparse.per_head_budgets, dtype=torch.long)
            if tuple(table.shape) != (kv.num_layers, kv.num_kv_heads):
                raise ValueError(
                    f"sparse.per_head_budgets is {list(table.shape)}; this model needs "
                    f"[{kv.num_layers}, {kv.num_kv_heads}] (layers x KV heads)"
                )
            self._layer_budgets = ((table + S - 1) // S).to(dev)

    def mandatory_pages(self, context_tokens: int) -> int:
        """Pages a head selects per step at most: sink + budget + local."""
        if self.algorithm.selects_all:
            return -(-context_tokens // self.kv.page_size)
        return self.sink_pages + self._max_budget_pages(context_tokens) + self.local_pages

    def _max_budget_pages(self, context_tokens: int) -> int:
        return max_middle_pages(self.sparse, self.kv.page_size, self.kv.num_kv_heads, context_tokens)

    def row(self, request_id: str) -> int:
        return self.kv.row(request_id)

    # ---- per step ------------------------------------------------------------------------------

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        S = self.kv.page_size
        decode = [c for c in chunks if c.is_decode]
        bd = len(decode)
        select = rows = None
        if bd:
            lens = [c.start + 1 for c in decode]
            num_pages = [-(-n // S) for n in lens]
            rows = torch.tensor([self.kv.row(c.request.request_id) for c in decode], dtype=torch.long).to(self.device)
            budgets = [-(-self.sparse.budget_tokens(n) // S) for n in lens]
            select = SelectPlan(
                num_pages=torch.tensor(num_pages, dtype=torch.long).to(self.device),
                tail_len=torch.tensor([(n - 1) % S + 1 for n in lens], dtype=torch.int32).to(self.device),
                sink_pages=self.sink_pages,
                local_pages=self.local_pages,
                budget_pages=torch.tensor(budgets, dtype=torch.long)[:, None]
                .expand(bd, self.kv.num_kv_heads).contiguous().to(self.device),
                max_pages=max(num_pages),
                max_budget=self._max_budget_pages(max(lens)),
                top_p=self.sparse.top_p,
            )
        prefill, start = [], bd
        for c in chunks[bd:]:
            prefill.append(SpinPrefill(start, c.num_tokens, c.start, c.request.request_id))
            start += c.num_tokens
        self.plan = SpinStepPlan(
            host_slots=self.kv.directory.token_slots(token_rows, positions),
            token_rows=token_rows,
            positions=positions,
            num_decode=bd,
            decode_rows=rows,
            select=select,
            prefill=tuple(prefill),
        )
        self.step_index += 1

    def end_step(self) -> None:
        self.plan = None
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    # ---- per layer ----------------------------------------------------------------------------

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        T, H, D = q.shape
        self._offload(plan.host_slots[layer_id].reshape(-1), k.reshape(-1, D), v.reshape(-1, D))
        self.algorithm.on_append(layer_id, plan.token_rows, plan.positions, k)
        out = torch.empty_like(q)  # [T, H, D]
        if plan.num_decode:
            bd = plan.num_decode
            self._decode_layer(layer_id, q[:bd], k[:bd], v[:bd], out[:bd])
        for seg in plan.prefill:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = self._prefill(layer_id, seg, q[rows], k[rows], v[rows])
        return out

    def _offload(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        host = self.kv.host
        if self._side is None:
            self._write(host.k_pages, host.v_pages, k, v, slots)
            return
        # The write to host memory runs beside the layer's compute; the step ends by waiting.
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._write(host.k_pages, host.v_pages, k, v, slots)
        for t in (k, v, slots):
            t.record_stream(self._side)

    def _decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """q [Bd, H, D]; k, v [Bd, Hkv, D] of the new tokens; writes out [Bd, H, D]."""
        plan, kv = self.plan, self.kv
        sel = plan.select
        # No wait for this layer's host write: Retrieve may copy the tail page without the new
        # token, and the write-through below puts it into the slot after Retrieve, on this
        # stream. Earlier steps' writes have landed (end_step waits).
        scores = None
        if not self.algorithm.selects_all:
            scores = self.algorithm.score(layer, q, plan.decode_rows, sel.max_pages)
            if self._layer_budgets is not None:  # per-(layer, head) budgets
                sel = dataclasses.replace(sel, budget_pages=self._layer_budgets[layer].expand_as(sel.budget_pages))
            if sel.top_p is not None:  # scores are q.k summed over the G query heads of a KV head
                sel = dataclasses.replace(sel, score_scale=kv.num_kv_heads / (q.shape[1] * q.shape[2] ** 0.5))
        want, num_selected = select_pages(scores, self.algorithm.selects_all, sel, kv.num_kv_heads)  # [Bd, Hkv, K]
        lookup, miss = kv.buffer.lookup(plan.decode_rows, layer, want, self.step_index)
        src = kv.directory.host_pages(plan.decode_rows, layer, want).view(-1)
        src = torch.where(miss.view(-1), src, -1)
        buf = kv.buffer
        self._retrieve(kv.host.k_pages, kv.host.v_pages, buf.k_slots, buf.v_slots, src, lookup.miss_dst)
        # Write-through: the new token into its tail page's slot (the last selected page).
        S = kv.page_size
        tail_slot = lookup.slots.gather(-1, (num_selected - 1).clamp(min=0)[..., None])[..., 0]  # [Bd, Hkv]
        flat = tail_slot.long() * S + (sel.tail_len.long() - 1)[:, None]
        D = q.shape[-1]
        self._write(buf.k_slots, buf.v_slots, k.reshape(-1, D), v.reshape(-1, D), flat.reshape(-1))
        lens = ((num_selected - 1) * S + sel.tail_len[:, None]).to(torch.int32)  # [Bd, Hkv]
        self._decode(q, buf.k_slots, buf.v_slots, lookup.slots, lens.contiguous(), out=out)

    def _prefill(self, layer: int, seg: SpinPrefill, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, H, D]; k, v [n, Hkv, D] -> [n, H, D]."""
        if seg.context_start == 0:
            return prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, self.sparse_prefill, layer)
        k_ctx, v_ctx = self._gather_context(layer, seg.request_id, seg.context_start + seg.num_tokens)
        return prefill_attention(q, k_ctx, v_ctx, seg.context_start, self.sparse_prefill, layer)

    def _gather_context(self, layer: int, request_id: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's first num_tokens K/V of this layer from the host tier: [Hkv, T, D]."""
        kv = self.kv
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        S = kv.page_size
        pages = kv.directory.request_host_pages(request_id, layer, -(-num_tokens // S))  # [Hkv, P']
        hkv, p = pages.shape
        D = kv.host.k_pages.shape[-1]
        k = torch.empty(hkv * p, S, D, dtype=kv.host.k_pages.dtype, device=self.device)
        v = torch.empty_like(k)
        dst = torch.arange(hkv * p, device=self.device)
        self._retrieve(kv.host.k_pages, kv.host.v_pages, k, v, pages.reshape(-1), dst)
        return k.view(hkv, p * S, D)[:, :num_tokens], v.view(hkv, p * S, D)[:, :num_tokens]


def max_middle_pages(sparse: SparseConfig, page_size: int, num_kv_heads: int, context_tokens: int) -> int:
    """Most middle pages one KV head may select per step at ``context_tokens``: its budget, the
    largest per-head budget, or under top-p the largest total of a layer's heads."""
    S = page_size
    if sparse.per_head_budgets is not None:
        rows = [[-(-b // S) for b in row] for row in sparse.per_head_budgets]
        return max(sum(row) for row in rows) if sparse.top_p is not None else max(max(row) for row in rows)
    pages = -(-sparse.budget_tokens(context_tokens) // S)
    return pages * num_kv_heads if sparse.top_p is not None else pages
