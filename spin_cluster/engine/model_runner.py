"""One step's inputs, plan, forward and logits.

The runner turns the scheduler's chunks into flat tensors (one host->device copy each), has
the attention backend build the step plan that every layer reads (``begin_step``), runs the
model, and returns the logits of the requests whose sequence is complete after this step, and
of the prompt positions whose requests asked for prompt logprobs.

Decode-only steps replay a CUDA graph (``model.cuda_graphs``) when the backend offers one
(``engine.cuda_graphs``): one launch a step instead of one per operator.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import repeat

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.backend import AttentionBackend
from spin_cluster.engine.cuda_graphs import DecodeGraphRunner
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.engine.step_threads import StepThreads
from spin_cluster.models import ModelConfig, load_model, random_model


@dataclass
class StepLogits:
    """What one step's forward returns."""

    logits: torch.Tensor  # [N, V] float32, row i for sampled[i]'s last position
    sampled: list[ScheduledChunk]
    # (a prefill chunk, [m, hidden] final hidden states of its positions start .. start+m-1,
    # which score the prompt tokens start+1 .. start+m) for the chunks whose requests asked for
    # prompt logprobs; their logits are the caller's to make, a block at a time ([m, V] of a
    # long chunk would be gigabytes)
    prompt: list[tuple[ScheduledChunk, torch.Tensor]] = field(default_factory=list)


def prompt_positions(chunk: ScheduledChunk) -> int:
    """How many of the chunk's positions score a prompt token (the one after each): all up
    to the prompt's second to last position, whose logits score its last token."""
    if chunk.request.params.prompt_logprobs is None or chunk.is_decode:
        return 0
    return max(0, min(chunk.start + chunk.num_tokens, len(chunk.request.prompt_token_ids) - 1) - chunk.start)


def load_engine_model(config: SpinConfig, path: str, dtype: torch.dtype, device: torch.device,
                      progress: bool) -> torch.nn.Module:
    """The config's model from ``path``: its weights, or random ones (``model.load_format=dummy``)."""
    overrides = config.model.hf_overrides
    if config.model.load_format == "dummy":
        return random_model(ModelConfig.from_folder(path, overrides), dtype, device)
    return load_model(path, dtype=dtype, device=device, progress=progress, overrides=overrides).eval()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attention: AttentionBackend, device: torch.device, *,
                 cuda_graph_max_batch: int = 0, progress: bool = False) -> None:
        self.model = model
        self.attention = attention  # begin_step / forward per layer / end_step
        self.device = device
        self.graphs: DecodeGraphRunner | None = (
            attention.decode_graphs(model, cuda_graph_max_batch, progress) if cuda_graph_max_batch else None)
        # The CPU's torch threads per step, by its token count (a served engine sets it;
        # None: the process's setting for every step).
        self.step_threads: StepThreads | None = None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], input_ids_dev: torch.Tensor | None = None, *,
                logits: bool = True) -> StepLogits:
        """Run one step: the logits of the sampled positions and of the scored prompt ones.

        input_ids_dev: [B] token ids already on the device for a decode-only batch (the last
        step's argmax, in ``chunks``' order), which the host does not know yet.
        logits False: the forward only (its K/V written, its collectives run), nothing
        returned: a head-parallel worker, whose rank 0 samples."""
        if input_ids_dev is not None and not all(c.is_decode for c in chunks):
            raise ValueError("device input ids are for decode-only batches")
        if self.step_threads is not None:
            self.step_threads.apply(sum(c.num_tokens for c in chunks))
        # Host int64 arrays, not lists: torch.tensor over Python lists costs ~1 us a token,
        # a third of a second before a 128K prompt's first kernel.
        input_ids, positions, token_rows = array("q"), array("q"), array("q")
        sample_idx, sampled, scored_idx, scored = [], [], [], []
        for chunk in chunks:
            row = self.attention.row(chunk.request.request_id)
            if input_ids_dev is None:
                tokens = chunk.request.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            else:
                tokens = [0]  # replaced by input_ids_dev
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            num_scored = prompt_positions(chunk)
            if num_scored:
                first = len(input_ids) - len(tokens)
                scored_idx.extend(range(first, first + num_scored))
                scored.append((chunk, num_scored))
            token_rows.extend(repeat(row, chunk.num_tokens))
            if chunk.completes_sequence or input_ids_dev is not None:  # (a pipelined step's pending token)
                sample_idx.append(len(input_ids) - 1)
                sampled.append(chunk)
        dev = self.device
        # [3, T] in one host->device copy: token ids, positions, table rows
        num_tokens = len(input_ids)
        input_ids.extend(positions)
        input_ids.extend(token_rows)
        host = torch.frombuffer(input_ids, dtype=torch.long) if num_tokens else torch.empty(0, dtype=torch.long)
        inputs = host.view(3, num_tokens).to(dev, non_blocking=True)
        input_ids_t, positions_t, token_rows_t = inputs.unbind(0)  # [T] each
        if input_ids_dev is not None:
            input_ids_t = input_ids_dev
        if self.graphs is not None and self.graphs.can_run(chunks):
            hidden = self.graphs.run(input_ids_t, positions_t, token_rows_t, chunks)  # [Bd, hidden]
            if not logits:
                return StepLogits(torch.empty(0, device=dev), [])
            return StepLogits(self.model.compute_logits(hidden), sampled)  # every decode request samples
        self.attention.begin_step(chunks, positions_t, token_rows_t)
        try:
            hidden = self.model(input_ids_t, positions_t, self.attention)  # [T, hidden]
        finally:
            self.attention.end_step()
        if not logits:
            return StepLogits(torch.empty(0, device=dev), [])
        prompt = []
        if scored_idx:
            rows = hidden[torch.tensor(scored_idx, dtype=torch.long).to(dev, non_blocking=True)]  # [M, hidden]
            prompt = list(zip((c for c, _ in scored), rows.split([m for _, m in scored])))
        if not sample_idx:
            return StepLogits(torch.empty(0, device=dev), [], prompt)
        if len(sample_idx) < num_tokens:
            hidden = hidden[torch.tensor(sample_idx, dtype=torch.long).to(dev, non_blocking=True)]
        return StepLogits(self.model.compute_logits(hidden), sampled, prompt)  # [N, V]
