"""CUDA graphs of decode-only steps, and what a backend declares to be captured.

A decode step replayed as a graph costs one launch instead of one per operator (hundreds per
layer). The model runner holds a ``DecodeGraphRunner`` when its backend offers one
(``AttentionBackend.decode_graphs``); two runners exist, one per kind of step plan:

    DecodeGraphs      ``PaddedCapture``: the GPU-only paged cache. One graph per padded
                      batch size, captured at start-up; the plan lives in persistent buffers
                      (``DecodeInputs``) filled before each replay; padding rows decode
                      nothing and write their K/V to a scratch page.
    SpinDecodeGraphs  ``PlannedCapture``: the offloaded Spin cache. One graph per (padded
                      batch size, Select width), captured once that shape repeats; the plan
                      is built inside the graph from device tensors (Offload, Index, Select,
                      Retrieve and the sparse attention all captured); padding entries decode
                      a one-token request of the backend's own (``padding_row``).

Backends build the runner; the runner knows them only through these two interfaces (both
``AttentionBackend``s, which a backend subclasses to offer graphs), so this module imports
no backend (vLLM keeps its graphs in ``cudagraph_dispatcher.py`` for the same
reason: a class built by two modules lives in a third).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch
from tqdm.auto import tqdm

from spin_cluster.engine.backend import AttentionBackend
from spin_cluster.engine.scheduler import ScheduledChunk


def cuda_graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to
    ``max_batch`` (as vLLM), and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphRunner(ABC):
    """What the model runner calls: ``can_run`` a step's chunks, ``run`` them, ``release``."""

    @abstractmethod
    def can_run(self, chunks: list[ScheduledChunk]) -> bool: ...

    @abstractmethod
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
            chunks: list[ScheduledChunk]) -> torch.Tensor:
        """input_ids, positions, rows: [B] of a decode-only batch -> [B, E] final hidden states."""

    def release(self) -> None:
        """Free the captured graphs (a head-parallel rank does before leaving its group) where
        later steps can capture them again; a runner that captures only at start-up keeps them."""


# ---- the padded capture (GPU-only cache) -------------------------------------------------------


class DecodeInputs(Protocol):
    """A padded decode batch's plan in persistent tensors (``paged_attention.DecodeBuffers``)."""

    input_ids: torch.Tensor  # [Bmax]
    positions: torch.Tensor  # [Bmax]

    def plan(self, padded: int) -> Any:
        """The backend's step plan over the first ``padded`` rows (the same views every time)."""

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, padded: int) -> None:
        """Copy a decode batch of B <= padded rows in; the rest become padding."""


class PaddedCapture(AttentionBackend):
    """A backend ``DecodeGraphs`` can capture: its layers read ``plan``, which the graphs set
    to ``graph_inputs(...).plan(size)`` for capture and keep for every replay."""

    device: torch.device
    plan: Any

    @abstractmethod
    def graph_inputs(self, max_batch: int) -> DecodeInputs: ...

    def decode_graphs(self, model: torch.nn.Module, max_batch: int, progress: bool = False):
        return DecodeGraphs(model, self, max_batch, progress) if self.device.type == "cuda" else None


class DecodeGraphs(DecodeGraphRunner):
    """CUDA graphs of the model's forward over decode-only batches, one per padded size.

    Every tensor a graph reads is a persistent buffer (``DecodeInputs``: token ids,
    positions, slot mapping, block tables, lengths), written before each replay; the weights
    and the page pool are persistent already. Block tables span ``max_model_len`` so that one
    graph serves every context length (the decode kernel stops at each request's length).
    """

    def __init__(self, model: torch.nn.Module, attention: PaddedCapture, max_batch: int, progress: bool) -> None:
        self.model = model
        self.attention = attention
        self.buffers = attention.graph_inputs(max_batch)
        self.sizes = cuda_graph_batch_sizes(max_batch)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # padded size -> [Bp, E] graph output
        self._capture(progress)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return bool(chunks) and len(chunks) <= self.sizes[-1] and all(c.is_decode for c in chunks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
            chunks: list[ScheduledChunk]) -> torch.Tensor:
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
            # A fresh plan for the capture: a plan keeps what its first layers compute (the
            # window layers' pages), and the graph must compute that itself at every replay.
            self.attention.plan = self.buffers.plan(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._hidden[size] = self.model(ids, pos, self.attention)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.current_stream(self.attention.device).wait_stream(stream)
        self.attention.plan = None


# ---- the planned capture (offloaded cache) -----------------------------------------------------


class PlannedCapture(AttentionBackend):
    """A backend ``SpinDecodeGraphs`` can capture: one that builds its step plan on the device
    from the step's token positions and rows (``step_plan``), so that the plan is inside the
    graph. ``SpinAttention`` is one; a head-parallel rank's Spin backend forwards to the one it
    wraps."""

    # torch.cuda.graph's capture_error_mode: "thread_local" where another thread's calls
    # (a process group's watchdog) may run during the capture.
    capture_error_mode: ClassVar[str] = "global"
    device: torch.device
    plan: Any

    @property
    @abstractmethod
    def graph_safe(self) -> bool:
        """Whether a decode-only step can be captured now (else the steps run eagerly)."""

    @abstractmethod
    def advance(self) -> None:
        """A new step: bump the step index the graph reads from device memory."""

    @abstractmethod
    def decode_pages(self, context_tokens: int) -> int:
        """The Select width in pages for a batch whose longest request holds this many tokens
        (one graph per width)."""

    @abstractmethod
    def step_plan(self, positions: torch.Tensor, token_rows: torch.Tensor, num_decode: int, pages: int) -> Any:
        """The plan of a decode-only step from device tensors only (no host sync)."""

    @abstractmethod
    def replayed(self) -> None:
        """A graph replayed a step: host bookkeeping an eager step does in ``end_step``."""

    def padding_row(self) -> int | None:
        """A row whose decode steps touch no request's state (its own page, Index entries and
        buffer share), with which a batch is padded up to a captured graph's size; None: the
        backend has none, and a graph serves one exact batch size."""
        return None

    def decode_graphs(self, model: torch.nn.Module, max_batch: int, progress: bool = False):
        return SpinDecodeGraphs(model, self, max_batch) if self.graph_safe else None


class SpinDecodeGraphs(DecodeGraphRunner):
    """CUDA graphs of decode-only steps on the offloaded cache, one per (padded batch size B,
    Select width P in pages: ``PlannedCapture.decode_pages``), captured lazily.

    A step's inputs (token ids, positions, rows) are copied into persistent buffers; the
    graph builds the step plan from them on the device (``step_plan``) and runs the model.
    What changes between steps lives in device memory the graph reads: the step index, the
    directory, the Index, the buffer's shares. P comes in eighths of a power of two, so a
    request growing from 32K to 128K tokens meets about 16 widths.

    Batches are padded with the backend's padding row (``PlannedCapture.padding_row``: a
    one-token request of its own that nobody runs), as vLLM pads: a batch of B requests runs
    as the smallest size in ``cuda_graph_batch_sizes`` that holds it, or, while that size has
    no graph yet, in the smallest captured graph of its width that holds it. A draining batch
    (its requests finishing one by one) thereby replays the full batch's graph instead of
    running an eager step at every size it passes: an eager step costs several graph
    replays in launches (48 to 117 ms against 8.8 at 16 x 32K on an H200). A padding entry
    costs its GEMM rows and a one-page Select and attention. Without a padding row a graph
    serves one exact batch size.

    A shape's steps run eagerly until it has run ``capture_after`` steps in a row (the first
    compiles its kernels: nothing may compile during a capture), then its graph is captured;
    capturing records the launches without running them, so state is not touched twice. A
    capture costs several eager steps, so a batch that changes every step is not captured at
    every size it passes; a size that a larger graph serves padded is captured only after
    ``capture_after_padded`` steps in a row (one request decoding alone for long gets its own
    graph; a drain does not pay for captures). At most ``max_graphs`` graphs are kept: past
    that, new shapes run eagerly. All graphs share one memory pool (they replay one at a
    time, and a graph's output is read before the next replay).
    """

    def __init__(self, model: torch.nn.Module, attention: PlannedCapture, max_batch: int,
                 max_graphs: int = 256, capture: bool = True, capture_after: int = 2,
                 capture_after_padded: int = 16) -> None:
        self.model = model
        self.attention = attention
        self.max_batch = max_batch
        self.max_graphs = max_graphs
        # capture=False runs the same static path eagerly (tests of the path on the CPU).
        self.capture = capture
        self.capture_after = capture_after
        self.capture_after_padded = capture_after_padded
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)  # (last shape, steps in a row)
        self.padding_row = attention.padding_row()
        self.sizes = cuda_graph_batch_sizes(max_batch) if self.padding_row is not None else None
        dev = attention.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.rows = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = None
        self.replays = 0  # steps that replayed a graph
        self.padded_replays = 0  # of which with padding entries
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
        pages = self.attention.decode_pages(max(c.start for c in chunks) + 1)
        key = (B if self.sizes is None else next(s for s in self.sizes if s >= B), pages)
        served = self._served_by(key, B)  # a captured graph that holds the batch, or None
        if served is not None and served != key and self._should_capture(key, self.capture_after_padded):
            served = None  # a size that stays: run it eagerly once, and capture its own graph
        size = key[0] if served is None else served[0]
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.rows[:B].copy_(rows)
        if size > B:  # padding entries: token 0 at position 0 of the padding row
            self.input_ids[B:size].zero_()
            self.positions[B:size].zero_()
            self.rows[B:size].fill_(self.padding_row)
        self.attention.advance()
        if served is not None:
            self._graphs[served].replay()
            self.replays += 1
            self.padded_replays += served[0] > B
            self.attention.replayed()
            return self._hidden[served][:B]
        hidden = self._forward(*key)
        if key not in self._graphs and self._should_capture(key):
            self._capture(key)
        return hidden[:B]

    def _served_by(self, key: tuple[int, int], B: int) -> tuple[int, int] | None:
        """The captured graph a batch of B requests runs in: its own size's, else (with a
        padding row) the smallest captured one of the same width that holds B."""
        if key in self._graphs:
            return key
        if self.padding_row is None:
            return None
        larger = [k for k in self._graphs if k[1] == key[1] and k[0] >= B]
        return min(larger) if larger else None

    def _should_capture(self, key: tuple[int, int], after: int | None = None) -> bool:
        """Count a step of ``key`` (eager, or served padded by a larger graph): whether to
        capture it now (``after`` steps of it in a row, by default ``capture_after``; room for
        one more graph)."""
        last, streak = self._streak
        streak = streak + 1 if key == last else 1
        self._streak = (key, streak)
        after = self.capture_after if after is None else after
        return self.capture and streak >= after and len(self._graphs) < self.max_graphs

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
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=self.attention.capture_error_mode):
            self._hidden[key] = self._forward(*key)
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.captures += 1
