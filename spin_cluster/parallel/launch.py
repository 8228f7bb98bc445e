"""Start N head-parallel ranks on this machine, generate, and collect rank 0's outputs.

    result = launch_generate(cfg, ["The capital of France is"], SamplingParams(temperature=0),
                             num_ranks=2)
    result.outputs[0].text, result.attention_rank_s, result.bubble_ratio

Each rank is a process (torch.distributed.elastic's ``start_processes``, spawn) joined into
one process group on 127.0.0.1: NCCL with one GPU per rank when the model runs on CUDA, gloo on the CPU. Rank 0
runs the engine (``HeadParallelEngine``: it schedules and samples), ranks 1..R-1 the workers
that run its plans (``RankWorker``), as a served engine's ranks do (``run_rank``). As with
any spawn start, a script must call it under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import queue as queue_mod
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from spin_cluster.config import SpinConfig
from spin_cluster.engine.device import resolve_device
from spin_cluster.engine.request import RequestOutput, SamplingParams
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.parallel.engine import HeadParallelEngine
from spin_cluster.parallel.group import backend_for, free_port
from spin_cluster.parallel.worker import RankWorker

_POLL_S = 0.5
_EXIT_GRACE_S = 60.0
# Spawning a rank and importing torch: seconds when idle, tens of seconds on a busy machine.
_START_TIMEOUT_S = 300.0
# Seconds ``close`` gives a rank to end on SIGTERM before SIGKILL.
_CLOSE_S = 5
# The signals start_processes takes over in the parent (TORCHELASTIC_SIGNALS_TO_HANDLE's
# default); run_ranks gives them back their handlers, so Ctrl-C stays KeyboardInterrupt.
_ELASTIC_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, name))
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelResult:
    outputs: list[RequestOutput]  # rank 0's, in the order of the prompts
    placement: HeadPlacement
    attention_rank_s: tuple[float, ...]  # [R] attention seconds of each rank, whole run
    attention_bubble_s: float  # summed over steps and layers: slowest rank minus mean rank
    num_preemptions: int  # rank 0's: only it schedules
    graph_replays: int = 0  # rank 0's decode steps that replayed a CUDA graph

    @property
    def bubble_ratio(self) -> float:
        """Bubble over the attention critical path (sum of per-layer slowest ranks)."""
        critical = self.attention_bubble_s + sum(self.attention_rank_s) / len(self.attention_rank_s)
        return self.attention_bubble_s / critical if critical > 0 else 0.0


def launch_generate(
    config: SpinConfig,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    num_ranks: int,
    placement: HeadPlacement | None = None,
    admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS,
) -> ParallelResult:
    """Run ``HeadParallelEngine.generate`` on ``num_ranks`` local processes: rank 0's engine
    built from ``config``, ``placement`` and ``admission_output_tokens`` (``Engine``'s), the
    other ranks' workers from ``config`` and ``placement``."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}: must be >= 1")
    if placement is not None and placement.num_ranks != num_ranks:
        raise ValueError(f"the placement is for {placement.num_ranks} ranks, not num_ranks={num_ranks}")
    device = resolve_device(config.model.device)
    if device.type == "cuda" and torch.cuda.device_count() < num_ranks:
        raise ValueError(f"{num_ranks} ranks need {num_ranks} GPUs, this machine has {torch.cuda.device_count()}")
    lead = functools.partial(_generate, list(prompts), params)
    args = (num_ranks, free_port(), device.type, config, placement, lead, admission_output_tokens)
    reports = run_ranks(run_rank, args, num_ranks)
    outputs, used_placement, rank_s, bubble_s, num_preemptions, replays, num_plans = reports[0]
    if any(reports[r] != num_plans for r in range(1, num_ranks)):
        raise RuntimeError(f"rank 0 sent {num_plans} plans, its workers ran {[reports[r] for r in range(1, num_ranks)]}")
    rank_s = tuple(rank_s[str(r)] for r in range(num_ranks))
    return ParallelResult(outputs, used_placement, rank_s, bubble_s, num_preemptions, replays)


def run_ranks(fn, args: tuple, num_ranks: int, timeout_s: float | None = None) -> dict:
    """Run ``fn(rank, *args, results)`` in ``num_ranks`` processes and return {rank: report}:
    every rank puts ``(rank, report)`` on the ``results`` queue before its teardown (leaving
    the process group), so that a teardown that hangs cannot hold the reports back.

    The processes are torch.distributed.elastic's (``start_processes``, spawn): it records a
    failing rank's traceback, which raises here as ``ChildFailedError`` naming the rank and
    its exit code, and ``close`` ends ranks with SIGTERM, then SIGKILL. ``timeout_s`` counts
    from the moment every rank has entered ``fn``, so that a slow start (spawning, importing
    torch on a busy machine) does not use it up; the start itself may take up to
    ``_START_TIMEOUT_S``. Past either, the ranks print the stacks of their threads to stderr
    (where a hang sits), are ended, and TimeoutError is raised. Ranks still running
    ``_EXIT_GRACE_S`` after the last report are ended the same way. ``fn`` must be importable
    by the children (a module-level function; a script calls this under
    ``if __name__ == "__main__":``)."""
    ctx = mp.get_context("spawn")
    results, entered = ctx.Queue(), ctx.Queue()
    handlers = {sig: signal.getsignal(sig) for sig in _ELASTIC_SIGNALS}  # start_processes replaces them
    with tempfile.TemporaryDirectory(prefix="spin-ranks-") as log_dir:
        procs = start_processes(
            name="head-parallel", entrypoint=_traced,
            args={rank: (rank, entered, fn, *args, results) for rank in range(num_ranks)},
            envs={rank: {} for rank in range(num_ranks)},
            logs_specs=DefaultLogsSpecs(log_dir=log_dir), start_method="spawn",
        )
        try:
            return _collect(procs, results, entered, num_ranks, timeout_s)
        finally:
            procs.close(timeout=_CLOSE_S)
            _restore_handlers(handlers)


def _restore_handlers(handlers: dict) -> None:
    """Only the main thread has signal handlers (start_processes set none elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _collect(procs, results, entered, num_ranks: int, timeout_s: float | None) -> dict:
    """The ranks' reports, then their exit (or, past the grace period, their end)."""
    start_deadline = None if timeout_s is None else time.monotonic() + _START_TIMEOUT_S
    deadline = None
    num_entered = 0
    reports = {}
    while len(reports) < num_ranks:
        try:
            rank, report = results.get(timeout=_POLL_S)
        except queue_mod.Empty:
            _raise_if_done(procs.wait(0), results, set(range(num_ranks)) - set(reports))
            if timeout_s is None:
                continue
            num_entered += _drain(entered)
            if deadline is None and num_entered == num_ranks:
                deadline = time.monotonic() + timeout_s
            if deadline is None and time.monotonic() > start_deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"{num_ranks - num_entered} of {num_ranks} ranks did not start within "
                                   f"{_START_TIMEOUT_S:.0f} s")
            if deadline is not None and time.monotonic() > deadline:
                _dump_stacks(procs)
                raise TimeoutError(f"{num_ranks} ranks did not finish within {timeout_s:.0f} s")
            continue
        reports[rank] = report
    # Every rank has reported: give them a grace period to leave the process group and exit,
    # then end them, so that a rank stuck in its teardown cannot hold the results back.
    done = procs.wait(timeout=_EXIT_GRACE_S, period=_POLL_S)
    if done is None:
        logger.warning("ranks did not exit %.0f s after reporting; ending them", _EXIT_GRACE_S)
        _dump_stacks(procs)
    elif done.is_failed():
        logger.warning("ranks failed after reporting: %s", ChildFailedError("head-parallel", done.failures))
    return reports


def _raise_if_done(done, results, missing: set[int]) -> None:
    """Raises when the ranks have ended (``done`` is ``procs.wait(0)``) before all reported:
    a failed rank's traceback, or the ranks that exited without a report."""
    if done is None:
        return
    if done.is_failed():
        raise ChildFailedError("head-parallel", done.failures)
    if results.empty():
        raise RuntimeError(f"ranks {sorted(missing)} exited without a report")


def _traced(rank: int, entered, fn, *args) -> None:
    """A rank's entry: SIGUSR1 prints the stacks of all its threads; the rank says it has
    entered (the parent's timeout starts once all have), then ``fn`` runs."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    entered.put(rank)
    fn(rank, *args)


def _drain(q) -> int:
    """How many items were waiting on ``q``, taking them off."""
    count = 0
    while True:
        try:
            q.get_nowait()
        except queue_mod.Empty:
            return count
        count += 1


def _dump_stacks(procs) -> None:
    """Every live rank prints the stacks of its threads (``_traced``'s SIGUSR1); the caller
    then ends them with ``procs.close``."""
    for pid in procs.pids().values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # let them print


def join_group(rank: int, num_ranks: int, port: int, device_type: str, config: SpinConfig) -> SpinConfig:
    """A rank process's start: its GPU (or its share of the CPU cores), then the process group
    on 127.0.0.1. Returns ``config`` with the model on this rank's device."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        config = config.replace(model={"device": f"cuda:{rank}"})
    else:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))
    backend = backend_for(torch.device(device_type))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    return config


def leave_group(engine: HeadParallelEngine | RankWorker | None) -> None:
    """A rank process's end: its engine's or worker's CUDA graphs first (they hold NCCL
    resources), then the process group."""
    if engine is not None:
        engine.release_cuda_graphs()
    dist.destroy_process_group()


def run_rank(rank: int, num_ranks: int, port: int, device_type: str, config: SpinConfig,
             placement: HeadPlacement | None, lead: Callable[[HeadParallelEngine], Any],
             admission_output_tokens: int, results) -> None:
    """A rank process of ``run_ranks``, whole: it joins the group and a gloo control group;
    rank 0 builds the engine, puts ``(0, lead(engine))`` on ``results`` and tells the workers
    to stop; ranks 1..R-1 build a ``RankWorker`` and put ``(rank, plans run)`` once stopped.
    Then each leaves the group. ``lead`` must pickle (a module-level function, or a partial
    of one)."""
    config = join_group(rank, num_ranks, port, device_type, config)
    control = dist.new_group(backend="gloo") if num_ranks > 1 else None
    node = None
    try:
        if rank == 0:
            node = HeadParallelEngine(config, placement, control_group=control, progress=False,
                                      admission_output_tokens=admission_output_tokens)
            report = lead(node)
            node.stop_workers()
        else:
            node = RankWorker(config, placement)
            node.serve(control)
            report = node.num_plans_run
        results.put((rank, report))
    finally:
        leave_group(node)


def _generate(prompts, params, engine: HeadParallelEngine) -> tuple:
    """``launch_generate``'s lead: the outputs and what ``ParallelResult`` reports."""
    outputs = engine.generate(prompts, params)
    st = engine.last_stats
    return (outputs, engine.placement, st.attention_rank_s_total, st.attention_bubble_s_total,
            engine.num_preemptions_total, engine.runner.graphs.replays if engine.runner.graphs is not None else 0,
            engine.num_plans_sent)
