"""How many torch threads each CPU step runs on.

A served CPU engine shares its cores with the ingress, the proxy, Ray's own processes and
often the load client. Its OpenMP threads meet at a barrier after every operator, so one
thread that loses its core holds the others at each of a decode step's ~1,200 operators.
A small decode step gains little from a second thread and loses much to that: SmolLM2's
batch-1 step took 23.5 ms on two threads and 26 ms on one in a quiet Ray actor, but 59-64
ms on two threads and 29-45 ms on one inside the served replica (2 vCPUs, AVX-512). Large
steps (prefill chunks, wide decode batches) are compute-bound and scale: 16 rows step in
58 ms on two threads against 126 ms on one. vLLM's CPU backend binds one thread per core it
keeps for the engine and leaves a core to its API server; this keeps that core free while
the steps are small and takes it back when a step is large enough to pay for it.

The CPU decode attention kernel (``cpu_native``) is the exception: it runs on ``large``
threads in every step. Its rows (request, KV head) are taken one at a time from a shared
counter by POSIX threads, not split into fixed OpenMP shares, so a thread that loses its core
delays the one row it holds while the others finish the rest. SmolLM2's 16 rows of 512 tokens,
pages in DRAM: 1.31 ms a layer on one thread, 0.79 on two, 1.18 on two with a busy loop taking
half of a core (2-vCPU AVX-512 EPYC).

Prefill steps (``block_tokens`` tokens or more) leave OpenMP out altogether: torch runs on one
thread, and the work that scales, the GEMMs and the attention, runs on ``large`` threads that
take their pieces from shared counters (the GEMMs' row blocks, ``cpu_linear.set_row_blocks``;
the native prefill attention's tiles). Served under guidellm at 2048-token prompts, the load
client's data worker held a whole core for the level's first ~50 s, and the two OpenMP
threads' 2048-token prefill steps took 8.5-12.7 s there against 3.6 s alone (then 5.4-6.0 s
beside its 35-75%): each thread had half a core, and each waited at every operator for the
other. Beside a loop taking a whole core, the same prefill in the engine took 5.0 s this way
against 5.8 on two OpenMP threads (6.5 before the native attention).
"""

from __future__ import annotations

import torch

from spin_cluster.kernels import cpu_native
from spin_cluster.models import cpu_linear

# Steps of this many tokens or more run as prefill steps (see the top): a GEMM splits into row
# blocks only from cpu_linear.ROW_BLOCKS_MIN_ROWS rows, and a step below that keeps OpenMP.
BLOCK_TOKENS = cpu_linear.ROW_BLOCKS_MIN_ROWS


class StepThreads:
    """``large`` threads for steps of at least ``min_tokens`` tokens, ``small`` for the rest;
    from ``block_tokens`` tokens (None: never) torch on one thread and the GEMMs' row blocks on
    ``large``.

    ``apply(num_tokens)`` runs on the thread that then runs the step (torch's OpenMP thread
    count belongs to the calling thread's team)."""

    def __init__(self, small: int, large: int, min_tokens: int, block_tokens: int | None = None) -> None:
        if small < 1 or large < small or min_tokens < 1 or (block_tokens is not None and block_tokens < min_tokens):
            raise ValueError(f"StepThreads needs 1 <= small <= large, min_tokens >= 1 and block_tokens >= min_tokens, "
                             f"got small={small}, large={large}, min_tokens={min_tokens}, block_tokens={block_tokens}")
        self.small = small
        self.large = large
        self.min_tokens = min_tokens
        self.block_tokens = block_tokens if large > 1 else None  # one thread: nothing to split
        self.current: tuple[int, int] | None = None  # (torch threads, row-block threads)

    def blocks(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` runs its GEMMs in row blocks (torch on one thread)."""
        return self.block_tokens is not None and num_tokens >= self.block_tokens

    def threads_for(self, num_tokens: int) -> int:
        """Torch's threads for a step of ``num_tokens``."""
        if self.blocks(num_tokens):
            return 1
        return self.large if num_tokens >= self.min_tokens else self.small

    def apply(self, num_tokens: int) -> int:
        want = (self.threads_for(num_tokens), self.large if self.blocks(num_tokens) else 1)
        if want != self.current:
            torch.set_num_threads(want[0])
            cpu_native.set_row_threads(self.large)
            cpu_linear.set_row_blocks(want[1])
            self.current = want
        return want[0]

    def __repr__(self) -> str:
        return (f"StepThreads(small={self.small}, large={self.large}, min_tokens={self.min_tokens}, "
                f"block_tokens={self.block_tokens})")
