"""One step's inputs, plan, forward and logits.

The runner turns the scheduler's chunks into flat tensors (one host->device copy each), has
the attention backend build the step plan that every layer reads (``begin_step``), runs the
model, and returns the logits of the requests whose sequence is complete after this step.

Decode-only steps replay a CUDA graph (``model.cuda_graphs``), so that a step costs one
launch instead of one per operator (hundreds per layer):

* GPU-only cache (``DecodeGraphs``): one graph per padded batch size, captured at start-up.
  The batch is padded up to the next captured size; padding rows decode nothing and write
  their K/V to a scratch page.
* Offloaded cache (``SpinDecodeGraphs``): one graph per (batch size, Select width), captured
  the first time that shape runs. The whole Spin step is in the graph: Offload, Index,
  Select, the buffer lookup, Retrieve, the write-through and the sparse attention.
"""

from __future__ import annotations

from array import array
from itertools import repeat

import torch
from tqdm.auto import tqdm

from spin_cluster.engine.backend import AttentionBackend
from spin_cluster.engine.paged_attention import DecodeBuffers, PagedAttention
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.engine.spin_attention import SpinAttention
from spin_cluster.engine.step_threads import StepThreads


def cuda_graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to
    ``max_batch`` (as vLLM), and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attention, device: torch.device, *,
                 cuda_graph_max_batch: int = 0, progress: bool = False) -> None:
        self.model = model
        self.attention = attention  # PagedAttention or SpinAttention: begin_step/forward/end_step
        self.device = device
        self.graphs: DecodeGraphs | SpinDecodeGraphs | None = (
            attention.decode_graphs(model, cuda_graph_max_batch, progress) if cuda_graph_max_batch else None)
        # The CPU's torch threads per step, by its token count (a served engine sets it;
        # None: the process's setting for every step).
        self.step_threads: StepThreads | None = None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk],
                input_ids_dev: torch.Tensor | None = None) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step. Returns ([N, V] float32 logits, the N chunks they belong to).

        input_ids_dev: [B] token ids already on the device for a decode-only batch (the last
        step's argmax, in ``chunks``' order), which the host does not know yet."""
        if input_ids_dev is not None and not all(c.is_decode for c in chunks):
            raise ValueError("device input ids are for decode-only batches")
        if self.step_threads is not None:
            self.step_threads.apply(sum(c.num_tokens for c in chunks))
        # Host int64 arrays, not lists: torch.tensor over Python lists costs ~1 us a token,
        # a third of a second before a 128K prompt's first kernel.
        input_ids, positions, token_rows = array("q"), array("q"), array("q")
        sample_idx, sampled = [], []
        for chunk in chunks:
            row = self.attention.row(chunk.request.request_id)
            if input_ids_dev is None:
                tokens = chunk.request.token_ids(chunk.start, chunk.start + chunk.num_tokens)
            else:
                tokens = [0]  # replaced by input_ids_dev
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
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
            return self.model.compute_logits(hidden), sampled  # every decode request samples
        self.attention.begin_step(chunks, positions_t, token_rows_t)
        try:
            hidden = self.model(input_ids_t, positions_t, self.attention)  # [T, hidden]
        finally:
            self.attention.end_step()
        if not sample_idx:
            return torch.empty(0, device=dev), []
        if len(sample_idx) < num_tokens:
            hidden = hidden[torch.tensor(sample_idx, dtype=torch.long).to(dev, non_blocking=True)]
        return self.model.compute_logits(hidden), sampled  # [N, V]


class DecodeGraphs:
    """CUDA graphs of the model's forward over decode-only batches, one per padded size.

    Every tensor a graph reads is a persistent buffer (``DecodeBuffers``: token ids,
    positions, slot mapping, block tables, lengths), written before each replay; the weights
    and the page pool are persistent already. Block tables span ``max_model_len`` so that one
    graph serves every context length (the decode kernel stops at each request's length).
    """

    def __init__(self, model: torch.nn.Module, attention: PagedAttention, max_batch: int, progress: bool) -> None:
        self.model = model
        self.attention = attention
        self.buffers = DecodeBuffers(attention.kv, max_batch)
        self.sizes = cuda_graph_batch_sizes(max_batch)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # padded size -> [Bp, E] graph output
        self._capture(progress)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return bool(chunks) and len(chunks) <= self.sizes[-1] and all(c.is_decode for c in chunks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
            chunks: list[ScheduledChunk]) -> torch.Tensor:
        """input_ids, positions, rows: [B] of a decode-only batch -> [B, E] final hidden states."""
        B = input_ids.shape[0]
        padded = next(s for s in self.sizes if s >= B)
        self.buffers.fill(input_ids, positions, rows, padded)
        self._graphs[padded].replay()
        return self._hidden[padded][:B]

    @torch.inference_mode()
    def _capture(self, progress: bool) -> None:
        pool = None
        stream = torch.cuda.Stream(self.attention.device)
        stream.wait_stream(torch.cuda.current_stream(self.attention.device))
        # Largest first: smaller graphs reuse the largest one's memory pool.
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing decode CUDA graphs", disable=not progress):
            self.attention.plan = self.buffers.plan(size)
            ids, pos = self.buffers.input_ids[:size], self.buffers.positions[:size]
            with torch.cuda.stream(stream):
                self.model(ids, pos, self.attention)  # warm-up: Triton compiles, cuBLAS picks kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._hidden[size] = self.model(ids, pos, self.attention)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.current_stream(self.attention.device).wait_stream(stream)
        self.attention.plan = None


class SpinGraphBackend(AttentionBackend):
    """Base of attention backends that wrap a ``SpinAttention`` and can stand in for it in
    ``SpinDecodeGraphs`` (a head-parallel rank's): they provide ``graph_safe``, ``device``,
    ``plan``, ``advance``, ``decode_pages``, ``step_plan``, ``forward``, ``end_step`` and
    ``replayed`` with its meanings."""

    def decode_graphs(self, model: torch.nn.Module, max_batch: int, progress: bool = False):
        return SpinDecodeGraphs(model, self, max_batch) if self.graph_safe else None


class SpinDecodeGraphs:
    """CUDA graphs of decode-only steps on the offloaded cache, one per (batch size B, Select
    width P in pages: ``SpinAttention.decode_pages``), captured lazily.

    A step's inputs (token ids, positions, rows) are copied into persistent buffers; the
    graph builds the step plan from them on the device (``SpinAttention.step_plan``) and runs
    the model. What changes between steps lives in device memory the graph reads: the step
    index (``SpinAttention.now``), the directory, the Index, the buffer's shares. Batches are
    not padded (a padding row would touch a real row's shares), so a graph serves one exact
    batch size; P comes in eighths of a power of two, so a request growing from 32K to 128K
    tokens meets about 16 widths.

    The first step of a new shape runs eagerly, which compiles its kernels (nothing may
    compile during a capture), then its graph is captured; capturing records the launches
    without running them, so state is not touched twice. At most ``max_graphs`` graphs are
    kept: past that, new shapes run eagerly. All graphs share one memory pool (they replay one
    at a time, and a graph's output is read before the next replay).
    """

    def __init__(self, model: torch.nn.Module, attention: SpinAttention | SpinGraphBackend, max_batch: int,
                 max_graphs: int = 256, capture: bool = True) -> None:
        self.model = model
        self.attention = attention
        self.max_batch = max_batch
        self.max_graphs = max_graphs
        # capture=False runs the same static path eagerly (tests of the path on the CPU).
        self.capture = capture
        dev = attention.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.rows = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = None
        self.replays = 0  # steps that replayed a graph
        self.captures = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Free every captured graph and their memory pool; later steps capture anew."""
        self._graphs.clear()
        self._hidden.clear()
        self._pool = None

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return bool(chunks) and len(chunks) <= self.max_batch and all(c.is_decode for c in chunks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
            chunks: list[ScheduledChunk]) -> torch.Tensor:
        B = len(chunks)
        key = (B, self.attention.decode_pages(max(c.start for c in chunks) + 1))
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.rows[:B].copy_(rows)
        self.attention.advance()
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            self.attention.replayed()
            return self._hidden[key]
        hidden = self._forward(*key)
        if self.capture and len(self._graphs) < self.max_graphs:
            self._capture(key)
        return hidden

    def _forward(self, B: int, pages: int) -> torch.Tensor:
        """The decode step of the first B buffered tokens, from device tensors only."""
        att = self.attention
        pos, rows = self.positions[:B], self.rows[:B]
        att.plan = att.step_plan(pos, rows, B, pages)
        try:
            return self.model(self.input_ids[:B], pos, att)  # [B, E]
        finally:
            att.end_step()

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int]) -> None:
        graph = torch.cuda.CUDAGraph()
        # A head-parallel rank captures NCCL all-reduces while the process group's watchdog
        # thread polls its own events: only this thread's calls must be capture-safe.
        mode = getattr(self.attention, "capture_error_mode", "global")
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
            self._hidden[key] = self._forward(*key)
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.captures += 1
