"""Attention over the paged KV cache: the engine's ``AttentionBackend``.

``StepPlan`` is built once per step by the model runner; ``forward`` runs per layer, reads
the plan and allocates nothing but its output. The T tokens of a step are laid out as::

    [ decode tokens (one per decoding request) | prefill chunk 0 | prefill chunk 1 | ... ]
      0 .. Bd-1                                  Bd ..

Decode tokens go through one paged-decode call (Triton on CUDA; on the CPU a C kernel that
reads the pages in place, ``kernels/cpu_native.py``, or where it cannot be built a gather
of each row's pages, planned once a step, and two batched matmuls); each prefill chunk
attends with torch SDPA to its request's earlier pages plus itself.

A sliding-window layer (Gemma 3; ``forward``'s ``window``) masks keys older than its window:
prefill through ``dense_attention.sliding_window_attention``, decode by gathering only the
pages a window can touch (``_decode_window``). The cache holds no page of such a layer behind
its window (``kvcache/window.py``): the table lists the scratch page there, K/V written there
are dropped, and both paths read only from the page of the window's first key on. A prompt
chunk reads its own K/V from this step's tensors, not from pages, since the cache keeps only
the chunk's last window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from spin_cluster.dense_attention import decode_impl, prefill_attention
from spin_cluster.engine.backend import BackendParts
from spin_cluster.engine.cuda_graphs import PaddedCapture
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kernels import cpu_native, paged_decode, paged_decode_cpu
from spin_cluster.kvcache.manager import KVCacheManager

if TYPE_CHECKING:
    from spin_cluster.sparse.prefill import BlockSparsePrefill


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int  # first index of the chunk in the step's T tokens
    num_tokens: int  # n
    context_start: int  # position of the chunk's first token in its request
    pages: tuple[torch.Tensor, ...]  # per layer [Hkv, P'] int64 page ids of positions 0 .. context_start+n-1


@dataclass(frozen=True)
class WindowPlan:
    """The decode rows' pages for one sliding window, every layer of that window at once:
    built by the first such layer of a step (``PagedAttention._window_plan``), read by all."""

    ids: torch.Tensor  # [L, Bd, Hkv, W] int32 page ids, the scratch page where a row has none
    # What the step's path reads, the other None: the SDPA path's mask, [Bd, W * S] bool, the
    # slots inside each row's window; or the decode kernel's seq_lens and key_starts (the
    # window's first key), [Bd] int32 each, counted from the first page on.
    keep: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    starts: torch.Tensor | None = None


@dataclass(frozen=True)
class StepPlan:
    """Everything a layer reads, indexed per layer in ``begin_step`` so that ``forward`` does
    no per-step arithmetic again."""

    slot_mapping: tuple[torch.Tensor, ...]  # per layer [T, Hkv] int64 flat slot of each token's K/V
    num_decode: int  # Bd
    # per layer [Bd, Hkv, P] int32 (strided); None where every layer has a window (they read
    # ``windows`` instead)
    decode_block_tables: tuple[torch.Tensor, ...] | None
    decode_seq_lens: torch.Tensor | None  # [Bd] int32, including the token being decoded
    prefill: tuple[PrefillSegment, ...]
    # The CPU's decode path: every layer's page ids and the length masks, built once a step
    gathered: paged_decode_cpu.GatheredDecodePlan | None = None
    # The window layers' decode: the decode rows' rows of ``decode_table`` ([R, L, Hkv, P]
    # int32), and per window its ``WindowPlan``, built by its first layer of the step. A plan
    # lives for one step, or for one graph capture (``DecodeGraphs`` gives its capture a fresh
    # plan, so that the graph computes the window pages itself).
    decode_table: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None
    windows: dict[int, WindowPlan] = field(default_factory=dict)


class DecodeBuffers:
    """The decode plan of a padded batch in persistent tensors, for CUDA-graph replay.

    A captured graph reads its inputs from fixed addresses, so a decode-only step copies its
    plan into these tensors (``fill``) instead of building new ones. Rows past the batch are
    padding: their K/V go to the pool's scratch page and their length is 0 (the kernel
    writes zeros for them)::

        rows:       0 .. B-1 (requests)  |  B .. Bp-1 (padding)
        seq_lens:   lengths              |  0
        slots:      their token slots    |  scratch page
    """

    def __init__(self, kv: KVCacheManager, max_batch: int) -> None:
        L, Hkv, P = kv.num_layers, kv.num_kv_heads, kv.table.max_pages_per_seq
        dev = kv.pool.k_pages.device
        self.kv = kv
        self.scratch_slot = kv.pool.scratch_page_id * kv.page_size
        self.slot_mapping = torch.full((L, max_batch, Hkv), self.scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_batch, L, Hkv, P, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.rows = torch.arange(max_batch, device=dev)  # the rows of ``block_tables``

    def plan(self, padded: int) -> StepPlan:
        """The plan over the first ``padded`` rows: the same views at capture and at replay."""
        return StepPlan(
            slot_mapping=tuple(self.slot_mapping[:, :padded].unbind(0)),
            num_decode=padded,
            decode_block_tables=tuple(self.block_tables[:padded].unbind(1)),
            decode_seq_lens=self.seq_lens[:padded],
            prefill=(),
            decode_table=self.block_tables,  # [Bmax, L, Hkv, P]
            decode_rows=self.rows[:padded],
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, padded: int) -> None:
        """Copy a decode batch (B tokens, table ``rows``) in; rows B .. padded-1 become padding."""
        B = input_ids.shape[0]
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.input_ids[B:padded].zero_()
        self.positions[B:padded].zero_()
        self.seq_lens[:B].copy_(positions + 1)
        self.seq_lens[B:padded].zero_()
        torch.index_select(self.kv.table.table, 0, rows, out=self.block_tables[:B])
        self.slot_mapping[:, :B].copy_(self.kv.slot_mapping(rows, positions))
        self.slot_mapping[:, B:padded].fill_(self.scratch_slot)


class PagedAttention(PaddedCapture):
    name = "paged"

    @classmethod
    def build(cls, kv: KVCacheManager, parts: BackendParts) -> PagedAttention:
        return cls(kv, parts.decode_attention, parts.prefill)

    def __init__(self, kv: KVCacheManager, decode: str = "auto", prefill: BlockSparsePrefill | None = None) -> None:
        self.kv = kv
        self.sparse_prefill = prefill  # None: dense prefill
        self.pool = kv.pool
        self.device = kv.pool.k_pages.device
        self._decode = decode_impl(decode, self.device)
        # 'auto' on the CPU: the in-place C kernel for float32 (or float16) pages where it
        # builds, else the step's gather plan once, then two matmuls a layer
        cpu_auto = decode == "auto" and self.device.type == "cpu"
        self._in_place = cpu_auto and cpu_native.reads_pages(kv.pool.k_pages.dtype)
        self._planned = cpu_auto and not self._in_place
        # Window layers' decode through the Triton kernel, reading the window's pages in place
        # (from each row's first key on); elsewhere a gather of those pages and one SDPA.
        self._window_kernel = self.device.type == "cuda" and decode in ("auto", "triton")
        D = kv.pool.head_dim
        self._k_flat = kv.pool.k_pages.view(-1, D)  # [(N+1)*S, D]: token slots
        self._v_flat = kv.pool.v_pages.view(-1, D)
        self.plan: StepPlan | None = None

    def row(self, request_id: str) -> int:
        return self.kv.table.row(request_id)

    def graph_inputs(self, max_batch: int) -> DecodeBuffers:
        return DecodeBuffers(self.kv, max_batch)

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        S = self.kv.page_size
        decode = [c for c in chunks if c.is_decode]
        num_decode = len(decode)
        block_tables = seq_lens = gathered = None
        rows = token_rows[:num_decode]
        if num_decode:
            seq_lens = (positions[:num_decode] + 1).to(torch.int32)  # [Bd]
            if self.kv.windows.num_full_layers:  # (window layers read only their windows' pages)
                lens = [c.start + 1 for c in decode]
                block_tables, gathered = self._full_layer_tables(
                    self.kv.block_tables(rows, -(-max(lens) // S)), seq_lens)
        segments = []
        token_start = num_decode
        for chunk in chunks[num_decode:]:
            end = chunk.start + chunk.num_tokens
            pages = ()
            if chunk.start:  # a later chunk reads its request's earlier pages
                row = self.row(chunk.request.request_id)
                pages = self.kv.table.table[row, :, :, : -(-end // S)].long().unbind(0)  # L x [Hkv, P']
            segments.append(PrefillSegment(token_start, chunk.num_tokens, chunk.start, pages))
            token_start += chunk.num_tokens
        self.plan = StepPlan(
            slot_mapping=self.kv.slot_mapping(token_rows, positions).unbind(0),
            num_decode=num_decode,
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill=tuple(segments),
            gathered=gathered,
            decode_table=self.kv.table.table,
            decode_rows=rows,
        )

    def decode_plan(self, positions: torch.Tensor, rows: torch.Tensor) -> StepPlan:
        """The plan of a decode-only step (token i of table row ``rows[i]`` at ``positions[i]``)
        from device tensors alone: no host sync, and every width fixed by the cache (full
        layers' tables span ``max_model_len``), so that a CUDA graph captures it with the model
        (the hybrid backend's window layers, ``HybridAttention.step_plan``)."""
        seq_lens = (positions + 1).to(torch.int32)  # [B]
        block_tables = gathered = None
        if self.kv.windows.num_full_layers:
            block_tables, gathered = self._full_layer_tables(self.kv.table.table[rows], seq_lens)
        return StepPlan(
            slot_mapping=self.kv.slot_mapping(rows, positions).unbind(0),
            num_decode=rows.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill=(),
            gathered=gathered,
            decode_table=self.kv.table.table,
            decode_rows=rows,
        )

    def _full_layer_tables(self, tables: torch.Tensor, seq_lens: torch.Tensor):
        """Decode rows' tables [B, L, Hkv, P] -> (per layer [B, Hkv, P], and on the CPU's
        planned path every layer's gathered pages, else None)."""
        gathered = None
        if self._planned:
            gathered = paged_decode_cpu.plan_gathered_decode(tables, seq_lens, self.pool.k_pages)
        return tables.unbind(1), gathered

    def end_step(self) -> None:
        self.plan = None

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        plan = self.plan
        D = q.shape[-1]
        # Write this step's K/V into their pages. k, v: [T, Hkv, D] -> [T*Hkv, D]
        slots = plan.slot_mapping[layer_id].view(-1)
        self._k_flat.index_copy_(0, slots, k.reshape(-1, D).to(self._k_flat.dtype))
        self._v_flat.index_copy_(0, slots, v.reshape(-1, D).to(self._v_flat.dtype))
        bd = plan.num_decode
        if not plan.prefill:  # a decode-only step: the kernel's output is the layer's
            return self._decode_rows(layer_id, q, window=window)
        if not bd and len(plan.prefill) == 1:
            return self._prefill(layer_id, plan.prefill[0], q, k, v, window)
        out = torch.empty_like(q)  # [T, H, D]
        if bd:
            self._decode_rows(layer_id, q[:bd], out[:bd], window)
        for seg in plan.prefill:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = self._prefill(layer_id, seg, q[rows], k[rows], v[rows], window)
        return out

    def _decode_rows(self, layer_id: int, q: torch.Tensor, out: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D] (into ``out`` when given)."""
        plan = self.plan
        if window is not None:
            o = self._decode_window(layer_id, q, window)
            return o if out is None else out.copy_(o)
        if plan.gathered is not None:
            return paged_decode_cpu.paged_decode_attention_planned(
                q, self.pool.k_pages, self.pool.v_pages, plan.gathered, layer_id, out=out)
        tables = plan.decode_block_tables[layer_id]  # [Bd, Hkv, P]
        if self._in_place and cpu_native.supports(q, self.pool.k_pages, tables.shape[1]):
            return cpu_native.paged_decode_attention_cpu(
                q, self.pool.k_pages, self.pool.v_pages, tables, plan.decode_seq_lens,
                q.shape[-1] ** -0.5, out=out)
        return self._decode(q, self.pool.k_pages, self.pool.v_pages, tables, plan.decode_seq_lens, out=out)

    def _decode_window(self, layer_id: int, q: torch.Tensor, window: int) -> torch.Tensor:
        """Decode rows of a sliding-window layer: each row's query at position L - 1 sees the
        keys at max(0, L - window) .. L - 1 only, from the W pages that can hold them (the
        step's ``WindowPlan``): read in place by the decode kernel from each row's first key
        (CUDA), or gathered and the rest masked in one SDPA. q [Bd, H, D] -> [Bd, H, D]."""
        wp = self.plan.windows.get(window)
        if wp is None:
            wp = self.plan.windows[window] = self._window_plan(window)
        ids = wp.ids[layer_id]  # [Bd, Hkv, W]
        if self._window_kernel:
            return paged_decode.paged_decode_attention(q, self.pool.k_pages, self.pool.v_pages, ids, wp.lens,
                                                       key_starts=wp.starts)
        Bd, Hkv, W = ids.shape
        S, D = self.kv.page_size, q.shape[-1]
        k = self.pool.k_pages[ids].view(Bd, Hkv, W * S, D).to(q.dtype)
        v = self.pool.v_pages[ids].view(Bd, Hkv, W * S, D).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=wp.keep[:, None, None, :], enable_gqa=True)  # [Bd, H, 1, D]
        return o[:, :, 0]

    def _window_plan(self, window: int) -> WindowPlan:
        """The decode rows' pages of every layer with this window, from the plan's table rows
        and lengths (device tensors only: a CUDA graph captures it)::

            page j of row b:  first_page[b] + j,  j < W = min(P, (window - 1) // S + 2)
                              (first_page[b]: the page of the window's first key)
            its slot t:       position (first_page[b] + j) * S + t, kept if in the window
        """
        plan, S = self.plan, self.kv.page_size
        table, rows = plan.decode_table, plan.decode_rows  # [R, L, Hkv, P], [Bd]
        lens = plan.decode_seq_lens.long()[:, None]  # [Bd, 1]
        starts = (lens - window).clamp(min=0)  # [Bd, 1] the window's first key
        W = min(table.shape[-1], (window - 1) // S + 2)  # pages a window can touch
        page_idx = starts // S + torch.arange(W, device=table.device)  # [Bd, W]
        page_ok = page_idx * S < lens  # pages past a row's end hold no key of it: read the scratch page
        page_idx = torch.where(page_ok, page_idx, 0)
        ids = table[rows[:, None], :, :, page_idx]  # [Bd, W, L, Hkv] int32
        ids = torch.where(page_ok[:, :, None, None], ids, self.pool.scratch_page_id)
        ids = ids.permute(2, 0, 3, 1).contiguous()  # [L, Bd, Hkv, W]: a layer's pages in one block
        if self._window_kernel:
            first = (starts // S) * S  # [Bd, 1] the position of the first page's first slot
            return WindowPlan(ids=ids, lens=(lens - first)[:, 0].to(torch.int32),
                              starts=(starts - first)[:, 0].to(torch.int32))
        pos = (page_idx[:, :, None] * S + torch.arange(S, device=table.device)).view(-1, W * S)
        keep = page_ok.repeat_interleave(S, dim=1) & (pos >= starts) & (pos < lens)  # [Bd, W*S]
        return WindowPlan(ids=ids, keep=keep)

    def _prefill(
        self, layer_id: int, seg: PrefillSegment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [n, H, D]; k, v: [n, Hkv, D] (this chunk) -> [n, H, D]."""
        if seg.context_start == 0:  # the whole context is this chunk: no gather
            return prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, self.sparse_prefill, layer_id,
                                     window)
        if window is not None:
            return self._prefill_window(layer_id, seg, q, k, v, window)
        end = seg.context_start + seg.num_tokens
        k_ctx = self._gather(self.pool.k_pages, seg.pages[layer_id], end).to(q.dtype)  # [Hkv, end, D]
        v_ctx = self._gather(self.pool.v_pages, seg.pages[layer_id], end).to(q.dtype)
        return prefill_attention(q, k_ctx, v_ctx, seg.context_start, self.sparse_prefill, layer_id, window)

    def _prefill_window(self, layer_id: int, seg: PrefillSegment, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, window: int) -> torch.Tensor:
        """A later chunk of a sliding-window layer: its keys are the earlier ones its first
        query reads, from their pages, then the chunk's own (``k``, ``v``)::

            positions  first .......... c-1 | c ........ c+n-1
            keys       pages p0 .. ceil(c/S)-1 | this step's k, v
                       (first = p0 * S, p0 the page of key c - window + 1)
        """
        S, c = self.kv.page_size, seg.context_start
        p0 = max(0, c - window + 1) // S
        pages = seg.pages[layer_id][:, p0 : -(-c // S)]  # [Hkv, P'']
        first = p0 * S
        k_ctx = torch.cat([self._gather(self.pool.k_pages, pages, c - first).to(k.dtype), k.transpose(0, 1)], 1)
        v_ctx = torch.cat([self._gather(self.pool.v_pages, pages, c - first).to(v.dtype), v.transpose(0, 1)], 1)
        # k_ctx, v_ctx: [Hkv, c + n - first, D], positions first ..
        return prefill_attention(q, k_ctx, v_ctx, c, self.sparse_prefill, layer_id, window, key_start=first)

    @staticmethod
    def _gather(pages: torch.Tensor, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """pages [N, S, D], page_ids [Hkv, P'] int64 -> [Hkv, num_tokens, D] contiguous in position."""
        hkv, p = page_ids.shape
        return pages[page_ids].reshape(hkv, p * pages.shape[1], pages.shape[2])[:, :num_tokens]
