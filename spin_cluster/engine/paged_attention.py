"""Attention over the paged KV cache: the engine's ``AttentionBackend``.

``StepPlan`` is built once per step by the model runner; ``forward`` runs per layer, reads
the plan and allocates nothing but its output. The T tokens of a step are laid out as::

    [ decode tokens (one per decoding request) | prefill chunk 0 | prefill chunk 1 | ... ]
      0 .. Bd-1                                  Bd ..

Decode tokens go through one paged-decode call (Triton on CUDA, the torch reference on the
CPU); each prefill chunk attends with torch SDPA to its request's earlier pages plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kernels import paged_decode
from spin_cluster.kvcache.manager import KVCacheManager

if TYPE_CHECKING:
    from spin_cluster.sparse.prefill import BlockSparsePrefill


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int  # first index of the chunk in the step's T tokens
    num_tokens: int  # n
    context_start: int  # position of the chunk's first token in its request
    pages: torch.Tensor  # [L, Hkv, P'] page ids covering positions 0 .. context_start+n-1


@dataclass(frozen=True)
class StepPlan:
    slot_mapping: torch.Tensor  # [L, T, Hkv] flat slot of each token's K/V
    num_decode: int  # Bd
    decode_block_tables: torch.Tensor | None  # [L, Bd, Hkv, P]
    decode_seq_lens: torch.Tensor | None  # [Bd] int32, including the token being decoded
    prefill: tuple[PrefillSegment, ...]


def decode_impl(name: str, device: torch.device):
    """'auto': the Triton kernel on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        return paged_decode.paged_decode_attention
    if name == "torch":
        return paged_decode.paged_decode_attention_ref
    raise ValueError(f"decode attention {name!r}: choose auto, triton or torch")


class PagedAttention:
    def __init__(self, kv: KVCacheManager, decode: str = "auto", prefill: BlockSparsePrefill | None = None) -> None:
        self.kv = kv
        self.sparse_prefill = prefill  # None: dense prefill
        self.pool = kv.pool
        self.device = kv.pool.k_pages.device
        self._decode = decode_impl(decode, self.device)
        self.plan: StepPlan | None = None

    def row(self, request_id: str) -> int:
        return self.kv.table.row(request_id)

    def begin_step(self, chunks: list[ScheduledChunk], positions: torch.Tensor, token_rows: torch.Tensor) -> None:
        S = self.kv.page_size
        decode = [c for c in chunks if c.is_decode]
        num_decode = len(decode)
        block_tables = seq_lens = None
        if num_decode:
            lens = [c.start + 1 for c in decode]
            rows = torch.tensor([self.row(c.request.request_id) for c in decode], dtype=torch.long).to(self.device)
            block_tables = self.kv.block_tables(rows, -(-max(lens) // S))  # [L, Bd, Hkv, P]
            seq_lens = torch.tensor(lens, dtype=torch.int32).to(self.device)  # [Bd]
        segments = []
        token_start = num_decode
        for chunk in chunks[num_decode:]:
            end = chunk.start + chunk.num_tokens
            pages = self.kv.table.table[self.row(chunk.request.request_id), :, :, : -(-end // S)]  # [L, Hkv, P']
            segments.append(PrefillSegment(token_start, chunk.num_tokens, chunk.start, pages))
            token_start += chunk.num_tokens
        self.plan = StepPlan(
            slot_mapping=self.kv.slot_mapping(token_rows, positions),
            num_decode=num_decode,
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill=tuple(segments),
        )

    def end_step(self) -> None:
        self.plan = None

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        T, H, D = q.shape
        # Write this step's K/V into their pages. k, v: [T, Hkv, D] -> [T*Hkv, D]
        slots = plan.slot_mapping[layer_id].reshape(-1)
        self.pool.k_pages.view(-1, D).index_copy_(0, slots, k.reshape(-1, D).to(self.pool.k_pages.dtype))
        self.pool.v_pages.view(-1, D).index_copy_(0, slots, v.reshape(-1, D).to(self.pool.v_pages.dtype))

        out = torch.empty_like(q)  # [T, H, D]
        bd = plan.num_decode
        if bd:
            self._decode(
                q[:bd],
                self.pool.k_pages,
                self.pool.v_pages,
                plan.decode_block_tables[layer_id],
                plan.decode_seq_lens,
                out=out[:bd],
            )
        for seg in plan.prefill:
            rows = slice(seg.token_start, seg.token_start + seg.num_tokens)
            out[rows] = self._prefill(layer_id, seg, q[rows], k[rows], v[rows])
        return out

    def _prefill(
        self, layer_id: int, seg: PrefillSegment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [n, H, D]; k, v: [n, Hkv, D] (this chunk) -> [n, H, D]."""
        if seg.context_start == 0:  # the whole context is this chunk: no gather
            return prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, self.sparse_prefill, layer_id)
        end = seg.context_start + seg.num_tokens
        k_ctx = self._gather(self.pool.k_pages, seg.pages[layer_id], end)  # [Hkv, end, D]
        v_ctx = self._gather(self.pool.v_pages, seg.pages[layer_id], end)
        return prefill_attention(q, k_ctx, v_ctx, seg.context_start, self.sparse_prefill, layer_id)

    @staticmethod
    def _gather(pages: torch.Tensor, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """pages [N, S, D], page_ids [Hkv, P'] -> [Hkv, num_tokens, D] contiguous in position."""
        hkv, p = page_ids.shape
        return pages[page_ids.long()].reshape(hkv, p * pages.shape[1], pages.shape[2])[:, :num_tokens]


def prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, context_start: int,
                      sparse: BlockSparsePrefill | None = None, layer: int = 0) -> torch.Tensor:
    """Causal SDPA of a prefill chunk against its request's context.

    q: [n, H, D] at positions context_start .. context_start + n - 1;
    k_ctx, v_ctx: [Hkv, context_start + n, D] (positions 0 ..). Returns [n, H, D].
    ``sparse``: block-sparse prefill instead (``sparse.prefill``), with ``layer``'s budgets.
    """
    if sparse is not None:
        return sparse(layer, q, k_ctx, v_ctx, context_start)
    n = q.shape[0]
    if context_start == 0:
        mask, causal = None, True
    else:
        # Query i sits at position context_start + i and sees keys 0 .. context_start + i.
        q_pos = torch.arange(context_start, context_start + n, device=q.device)
        mask = torch.arange(context_start + n, device=q.device)[None, :] <= q_pos[:, None]  # [n, end]
        causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        k_ctx.unsqueeze(0).to(q.dtype),
        v_ctx.unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)  # [n, H, D]
