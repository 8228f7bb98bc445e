"""One step's inputs, plan, forward and logits.

The runner turns the scheduler's chunks into flat tensors (one host->device copy each), has
the attention backend build the step plan that every layer reads (``begin_step``), runs the
model, and returns the logits of the requests whose sequence is complete after this step.
"""

from __future__ import annotations

import torch

from spin_cluster.engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attention, device: torch.device) -> None:
        self.model = model
        self.attention = attention  # PagedAttention or SpinAttention: begin_step/forward/end_step
        self.device = device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step. Returns ([N, V] float32 logits, the N chunks they belong to)."""
        input_ids, positions, token_rows = [], [], []
        sample_idx, sampled = [], []
        for chunk in chunks:
            row = self.attention.row(chunk.request.request_id)
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
        self.attention.begin_step(chunks, positions_t, token_rows_t)
        try:
            hidden = self.model(input_ids_t, positions_t, self.attention)  # [T, hidden]
        finally:
            self.attention.end_step()
        if not sample_idx:
            return torch.empty(0, device=dev), []
        idx = torch.tensor(sample_idx, dtype=torch.long).to(dev)
        return self.model.compute_logits(hidden[idx]), sampled  # [N, V]
