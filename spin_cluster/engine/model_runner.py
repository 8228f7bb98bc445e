"""One step's inputs, plan, forward and logits.

The runner turns the scheduler's chunks into flat tensors (one host->device copy each),
builds the ``StepPlan`` that every layer's attention reads, runs the model, and returns the
logits of the requests whose sequence is complete after this step (the ones to sample).
"""

from __future__ import annotations

import torch

from spin_cluster.engine.paged_attention import PagedAttention, PrefillSegment, StepPlan
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kvcache.manager import KVCacheManager


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, decode_attention: str = "auto") -> None:
        self.model = model
        self.kv = kv
        self.device = kv.pool.k_pages.device
        self.attention = PagedAttention(kv.pool, decode_attention)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step. Returns ([N, V] float32 logits, the N chunks they belong to)."""
        input_ids, positions, token_rows = [], [], []
        sample_idx, sampled = [], []
        request_rows = [self.kv.table.row(c.request.request_id) for c in chunks]
        for chunk, row in zip(chunks, request_rows):
            tokens = chunk.request.all_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            token_rows.extend([row] * chunk.num_tokens)
            if chunk.completes_sequence:
                sample_idx.append(len(input_ids) - 1)
                sampled.append(chunk)
        dev = self.device
        input_ids_t = torch.tensor(input_ids, dtype=torch.long).to(dev)  # [T]
        positions_t = torch.tensor(positions, dtype=torch.long).to(dev)  # [T]
        token_rows_t = torch.tensor(token_rows, dtype=torch.long).to(dev)  # [T]
        self.attention.plan = self._plan(chunks, request_rows, positions_t, token_rows_t)
        try:
            hidden = self.model(input_ids_t, positions_t, self.attention)  # [T, hidden]
        finally:
            self.attention.plan = None
        if not sample_idx:
            return torch.empty(0, device=dev), []
        idx = torch.tensor(sample_idx, dtype=torch.long).to(dev)
        return self.model.compute_logits(hidden[idx]), sampled  # [N, V]

    def _plan(
        self,
        chunks: list[ScheduledChunk],
        request_rows: list[int],
        positions: torch.Tensor,
        token_rows: torch.Tensor,
    ) -> StepPlan:
        S = self.kv.page_size
        decode = [(c, r) for c, r in zip(chunks, request_rows) if c.is_decode]
        num_decode = len(decode)
        block_tables = seq_lens = None
        if num_decode:
            lens = [c.start + 1 for c, _ in decode]
            rows = torch.tensor([r for _, r in decode], dtype=torch.long).to(self.device)
            block_tables = self.kv.block_tables(rows, -(-max(lens) // S))  # [L, Bd, Hkv, P]
            seq_lens = torch.tensor(lens, dtype=torch.int32).to(self.device)  # [Bd]
        segments = []
        token_start = num_decode
        for chunk, row in zip(chunks[num_decode:], request_rows[num_decode:]):
            end = chunk.start + chunk.num_tokens
            pages = self.kv.table.table[row, :, :, : -(-end // S)]  # [L, Hkv, P']
            segments.append(PrefillSegment(token_start, chunk.num_tokens, chunk.start, pages))
            token_start += chunk.num_tokens
        return StepPlan(
            slot_mapping=self.kv.slot_mapping(token_rows, positions),
            num_decode=num_decode,
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill=tuple(segments),
        )
