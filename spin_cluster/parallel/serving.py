"""What the ranks of a served head-parallel engine run: rank 0 (``LeaderEngine``) in the
serving process, ranks 1..R-1 (``FollowerRank``) in processes the server starts.

    store = host_store(num_ranks, timeout_s)                  # rank 0's rendezvous
    spec = RankSpec(config, placement, num_ranks, store.port)  # goes to every rank
    # the server starts each follower r >= 1:   FollowerRank(spec, r).serve()
    engine = start_leader(spec, store, followers)              # rank 0 here
    rid = engine.add_request(token_ids, params)                # checked and queued here only
    outputs = engine.step()                                    # rank 0 schedules, the plan goes out, all step
    engine.dead_followers()                                    # {rank: how it ended}, from ``followers``
    engine.shutdown()                                          # "stop", then ``followers.stop``

This module starts no process: the server does (``spin_cluster.deployments.head_parallel``
runs each follower as a Ray actor) and hands rank 0 a ``FollowerRanks``, through which rank 0
asks which followers have ended and stops them.

Only rank 0 schedules. A server drives one engine object (the engine loop's thread calls
it), rank 0's ``LeaderEngine``: a ``HeadParallelEngine`` with the ``Engine`` API, which sends
each step's plan (its cache calls and chunks, ``spin_cluster.parallel.plan``) to the
followers over a gloo control group before its forward; each follower's ``RankWorker`` runs
it. Requests, aborts, tokenizing, sampling and stop strings stay on rank 0; a refused
request never reaches a follower::

    rank 0:    add(a) add(b) abort(c) step: schedule, then
                 ──StepPlan(ops=[("free", "c"), ("allocate", "a", 8, 1, ()), ...], chunks=[...])──▶
    followers: the cache calls, then the forward: the same collectives

Rendezvous. Rank 0 hosts the TCPStore on a port the OS picks (no free-port race); every rank
joins the process group through it (NCCL on GPU, gloo on CPU; ``timeout_s`` bounds every
collective of a step and the start) and then the gloo control group. A server can sit idle
for days with the followers blocked on their next command, so the control group's timeout is
long; a follower still leaves as soon as rank 0 is gone, because the control connection
closes.

Failures. A follower that dies makes rank 0's next broadcast or all-reduce raise, so the step
fails, and ``dead_followers`` names it (the engine server's health check). ``shutdown`` sends
"stop" (a follower's ``serve`` then leaves the group and returns ``EXIT_STOPPED``) and has
``followers.stop`` end what is left. Rank 0 is the one supervisor of its followers: it starts
them (through the server's ``FollowerRanks``), gives them every step, asks after them and
ends them.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine.device import resolve_device
from spin_cluster.engine.request import RequestOutput
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.parallel.engine import HeadParallelEngine
from spin_cluster.parallel.group import backend_for
from spin_cluster.parallel.worker import EXIT_STOPPED, RankWorker, first_line

logger = logging.getLogger(__name__)

# Seconds a step's collectives (and the start: rendezvous, engine construction) may wait.
DEFAULT_TIMEOUT_S = 120.0
# The control group's: a follower waits for its next command for as long as the server idles.
_CONTROL_TIMEOUT = timedelta(days=365)
STORE_HOST = "127.0.0.1"  # every rank of one engine runs on one node


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one served engine is built from; pickled to each follower."""

    config: SpinConfig
    placement: HeadPlacement | None  # None: every rank places the heads with default_placement
    num_ranks: int  # R >= 1
    store_port: int  # rank 0's TCPStore on STORE_HOST
    timeout_s: float = DEFAULT_TIMEOUT_S  # seconds a collective or the start may wait, > 0
    cpu_threads: int = 0  # a CPU follower's torch threads; 0: cpu_count // R
    gpu_index: int = 0  # the CUDA device of each rank in its own process (one GPU per process)
    # Rank 0's Engine(admission_output_tokens=...): the followers do not schedule.
    admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS


class FollowerRanks(ABC):
    """Ranks 1..R-1 of one engine, as the server started them. Rank 0 only asks and stops;
    how the processes are run (and reaped) is the server's."""

    @abstractmethod
    def pids(self) -> list[int]:
        """Process ids of ranks 1..R-1, in rank order."""

    @abstractmethod
    def dead(self) -> dict[int, int | str]:
        """{rank: its serve's exit code, or why it died} of the followers that have ended
        (empty: all are serving)."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every follower to end (it has been told to stop, or
        is being abandoned), then end the rest; nothing of them is left running after it."""


class LeaderEngine(HeadParallelEngine):
    """Rank 0 of a served head-parallel engine, driven like an ``Engine``, with the followers
    the server started: it sends them each step over ``control_group`` (all ranks, gloo),
    asks after them and stops them.

    ``start_leader`` builds one with its followers; built directly (no ``followers``), the
    caller runs the other ranks and owns the process group."""

    def __init__(
        self,
        config: SpinConfig | None = None,
        placement: HeadPlacement | None = None,
        *,
        control_group,
        group=None,
        followers: FollowerRanks | None = None,
        decode_attention: str = "auto",
        progress: bool = True,
        admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS,
    ) -> None:
        self._followers = followers
        self._owns_process_group = False
        self._store = None  # the rendezvous store, kept alive with the group
        self._stopped = False
        super().__init__(config, placement, control_group=control_group, group=group,
                         decode_attention=decode_attention, progress=progress,
                         admission_output_tokens=admission_output_tokens)

    def step(self) -> list[RequestOutput]:
        if self._stopped:
            raise RuntimeError("the head-parallel engine has been shut down")
        return super().step()

    # ---- followers ------------------------------------------------------------------------

    @property
    def follower_pids(self) -> list[int]:
        return self._followers.pids() if self._followers is not None else []

    def dead_followers(self) -> dict[int, int | str]:
        """{rank: exit code or cause} of the followers that have ended (empty: all alive)."""
        return self._followers.dead() if self._followers is not None else {}

    def followers_alive(self) -> bool:
        return not self.dead_followers()

    def shutdown(self, *, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the followers and, when started by ``start_leader``, leave the process group.
        Idempotent; the engine refuses to step afterwards.

        graceful: send "stop" first. Call it so only from the thread that steps, or once that
        thread has stopped (the control group is not shared between threads); with False the
        followers are ended without a word. ``followers.stop`` ends those still running
        after ``timeout_s``."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if graceful and self.followers_alive():
                _call_with_deadline(self.stop_workers, timeout_s)
            if self._followers is not None:
                self._followers.stop(timeout_s)
        finally:
            if self._owns_process_group and dist.is_initialized():
                self.release_cuda_graphs()
                dist.destroy_process_group()
            self._store = None


def host_store(num_ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Rank 0's rendezvous store on STORE_HOST, on a port the OS picks (``store.port``)."""
    return dist.TCPStore(STORE_HOST, 0, num_ranks, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def check_spec(spec: RankSpec) -> None:
    """Raises ValueError where ``spec`` cannot run, before any rank is started."""
    if spec.num_ranks < 1:
        raise ValueError(f"num_ranks={spec.num_ranks}: give a placement or num_ranks >= 1")
    if spec.placement is not None and spec.placement.num_ranks != spec.num_ranks:
        raise ValueError(f"the placement is for {spec.placement.num_ranks} ranks, not num_ranks={spec.num_ranks}")
    refusal = spec.config.head_parallel_refusal()
    if refusal is not None:
        raise ValueError(refusal)


def start_leader(
    spec: RankSpec,
    store,
    followers: FollowerRanks,
    *,
    decode_attention: str = "auto",
    progress: bool = False,
) -> LeaderEngine:
    """Rank 0 in this process: joins torch.distributed's default group (this process must
    not be in one yet) through ``store`` while the followers join theirs, and returns its
    engine once every rank has built its own. This process keeps its own torch threads. On
    a failure the group is left and ``followers.stop`` is called before the error is raised."""
    check_spec(spec)
    if dist.is_initialized():
        raise ValueError("this process is already in a torch.distributed process group")
    try:
        config = _rank_device(spec)
        control = _join_group(spec, 0, store)
        engine = LeaderEngine(config, spec.placement, control_group=control, followers=followers,
                              decode_attention=decode_attention, progress=progress,
                              admission_output_tokens=spec.admission_output_tokens)
    except BaseException:
        followers.stop(timeout_s=1.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    engine._owns_process_group = True
    engine._store = store
    return engine


class FollowerRank:
    """Rank ``rank`` >= 1 of a served engine, in its own process: built, it has joined the
    group and built its ``RankWorker`` (as rank 0 builds its engine); ``serve`` then runs rank
    0's plans until "stop" or until rank 0 is gone."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        if not 1 <= rank < spec.num_ranks:
            raise ValueError(f"a follower's rank is in 1 .. {spec.num_ranks - 1}, not {rank}")
        self.rank = rank
        config = _rank_device(spec)
        if config.model.device == "cpu":  # share the cores instead of oversubscribing them
            torch.set_num_threads(spec.cpu_threads or max(1, (os.cpu_count() or 1) // spec.num_ranks))
        store = dist.TCPStore(STORE_HOST, spec.store_port, spec.num_ranks, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        self._control = _join_group(spec, rank, store)
        self.worker = RankWorker(config, spec.placement)

    def serve(self) -> int:
        """EXIT_STOPPED (the group left) or EXIT_LEADER_GONE; an error in a plan raises."""
        code = self.worker.serve(self._control)
        if code == EXIT_STOPPED:
            self.worker.release_cuda_graphs()
            dist.destroy_process_group()
        return code


# ---- helpers --------------------------------------------------------------------------------


def _rank_device(spec: RankSpec) -> SpinConfig:
    """The spec's config on this process's device: its ``gpu_index`` on CUDA (the server
    gives each rank's process its own GPU), else the CPU."""
    config = spec.config
    device = resolve_device(config.model.device)
    if device.type != "cuda":
        return config.replace(model={"device": "cpu"})
    if torch.cuda.device_count() <= spec.gpu_index:
        raise ValueError(f"a rank uses cuda:{spec.gpu_index}, this process sees {torch.cuda.device_count()} GPUs")
    torch.cuda.set_device(spec.gpu_index)
    return config.replace(model={"device": f"cuda:{spec.gpu_index}"})


def _join_group(spec: RankSpec, rank: int, store):
    """The default group (the attention's collectives) and the gloo control group."""
    device = resolve_device(spec.config.model.device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=spec.num_ranks,
                            timeout=timedelta(seconds=spec.timeout_s))
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def _call_with_deadline(fn, timeout_s: float) -> None:
    """Run ``fn`` on a daemon thread for at most ``timeout_s`` seconds (a stuck peer cannot
    hold the caller); errors are logged, not raised."""

    def run() -> None:
        try:
            fn()
        except Exception as e:
            logger.warning("could not tell the followers to stop: %s", first_line(e))

    thread = threading.Thread(target=run, name="head-parallel-stop", daemon=True)
    thread.start()
    thread.join(timeout_s)
