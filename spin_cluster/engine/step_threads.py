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
"""

from __future__ import annotations

import torch

from spin_cluster.kernels import cpu_native


class StepThreads:
    """``large`` threads for steps of at least ``min_tokens`` tokens, ``small`` for the rest.

    ``apply(num_tokens)`` runs on the thread that then runs the step (torch's OpenMP thread
    count belongs to the calling thread's team)."""

    def __init__(self, small: int, large: int, min_tokens: int) -> None:
        if small < 1 or large < small or min_tokens < 1:
            raise ValueError(f"StepThreads needs 1 <= small <= large and min_tokens >= 1, got "
                             f"small={small}, large={large}, min_tokens={min_tokens}")
        self.small = small
        self.large = large
        self.min_tokens = min_tokens
        self.current: int | None = None

    def threads_for(self, num_tokens: int) -> int:
        return self.large if num_tokens >= self.min_tokens else self.small

    def apply(self, num_tokens: int) -> int:
        threads = self.threads_for(num_tokens)
        if threads != self.current:
            torch.set_num_threads(threads)
            cpu_native.set_row_threads(self.large)
            self.current = threads
        return threads

    def __repr__(self) -> str:
        return f"StepThreads(small={self.small}, large={self.large}, min_tokens={self.min_tokens})"
