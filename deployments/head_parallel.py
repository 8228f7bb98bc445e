"""Head-parallel ranks of an engine replica as Ray actors: rank 0 in the replica's process,
ranks 1..R-1 one ``RankActor`` each, in the replica's placement group.

    bundles = rank_bundles(R, gpu=True, num_cpus=4)    # app.py: the EngineServer's placement_group_bundles
    engine = start_head_parallel(spin, placement)       # in the replica: its LeaderEngine
    engine.step(); engine.dead_followers(); engine.shutdown()

    placement group (STRICT_PACK, one node)
    ┌ bundle 0 ───────────┐ ┌ bundle 1 ──────┐     ┌ bundle R-1 ────┐
    │ EngineServer replica│ │ RankActor      │ ... │ RankActor      │
    │ rank 0: LeaderEngine│ │ rank 1: worker │     │ rank R-1 worker│
    └─────────┬───────────┘ └───────┬────────┘     └───────┬────────┘
              └── process group: NCCL (GPU) / gloo (CPU), + a gloo control group ──┘

Rank 0 stays in the replica's process, not in an actor of its own: the engine loop drives it
as any ``Engine`` (add_request, abort, step, and between steps the scheduler, cache and
tokenizer that checks and reports read), so an actor would have to proxy that whole surface
and add a remote call to every step. What crosses processes is only what the followers need to
run rank 0's schedule: each step's plan (its cache calls and chunks), broadcast by rank 0 over
the control group before its forward (``spin_cluster.parallel.serving``); a follower runs a
``RankWorker``, which schedules and samples nothing.

Ray owns the followers' processes. Each actor's ``serve`` call runs for the actor's whole
life: it returns when rank 0 says "stop", and fails when the actor dies, so its ObjectRef
is the liveness signal ``dead_followers`` polls (the health check). The actors are owned by
the replica and live in its placement group: when the replica is gone (stopped, replaced, or
killed), Ray ends them; ``shutdown`` kills them once they have stopped. A follower's logs
(and the traceback of a failed call) are in Ray's worker logs of its actor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spin_cluster.config import SpinConfig
from spin_cluster.deployments.settings import rank_bundles
from spin_cluster.engine.device import resolve_device
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.parallel.serving import (
    DEFAULT_TIMEOUT_S,
    FollowerRank,
    FollowerRanks,
    LeaderEngine,
    RankSpec,
    check_spec,
    host_store,
    start_leader,
)

logger = logging.getLogger(__name__)

# Seconds ``stop`` waits for killed actors' calls to fail (the processes to be gone).
_KILL_WAIT_S = 2.0


@ray.remote(max_restarts=0)
class RankActor:
    """One follower rank: ``start`` joins the group and builds the rank's worker, ``serve``
    runs until rank 0 says "stop" (or is gone). One call at a time, in order."""

    def __init__(self) -> None:
        self._rank: FollowerRank | None = None

    def pid(self) -> int:
        return os.getpid()

    def start(self, spec: RankSpec, rank: int) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
        self._rank = FollowerRank(spec, rank)

    def serve(self) -> int:
        return self._rank.serve()


class RayFollowers(FollowerRanks):
    """The ``RankActor`` of each rank 1..R-1, and the placement group when it was made for them."""

    def __init__(self, actors: list, own_group: PlacementGroup | None) -> None:
        self._actors = actors
        self._own_group = own_group
        self._pids: list[int] = []
        self._started: list = []  # ObjectRefs of the start calls
        self._served: list = []  # ObjectRefs of the serve calls: ready once a follower has ended

    def start(self, spec: RankSpec) -> None:
        """Their process ids (the actors are up), then each joins and serves."""
        self._pids = ray.get([a.pid.remote() for a in self._actors], timeout=spec.timeout_s)
        self._started = [a.start.remote(spec, rank) for rank, a in enumerate(self._actors, start=1)]
        self._served = [a.serve.remote() for a in self._actors]

    def wait_started(self, timeout_s: float) -> None:
        """Raises a follower's start error (rank 0's own start succeeded: the ranks built alike)."""
        ray.get(self._started, timeout=timeout_s)

    def pids(self) -> list[int]:
        return list(self._pids)

    def dead(self) -> dict[int, int | str]:
        if not self._served:
            return {}
        ready, _ = ray.wait(self._served, num_returns=len(self._served), timeout=0)
        return {rank: _outcome(ref) for rank, ref in enumerate(self._served, start=1) if ref in ready}

    def stop(self, timeout_s: float) -> None:
        if self._served:
            ray.wait(self._served, num_returns=len(self._served), timeout=timeout_s)
        for actor in self._actors:  # a stopped follower's actor is idle, not gone: end it
            ray.kill(actor, no_restart=True)
        if self._served:
            ray.wait(self._served, num_returns=len(self._served), timeout=_KILL_WAIT_S)
        if self._own_group is not None:
            remove_placement_group(self._own_group)
            self._own_group = None


def start_head_parallel(
    config: SpinConfig,
    placement: HeadPlacement | None = None,
    *,
    num_ranks: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cpu_threads: int = 0,
    group: PlacementGroup | None = None,
    admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS,
) -> LeaderEngine:
    """Rank 0 in this process, ranks 1 .. R-1 as ``RankActor``s in bundles 1 .. R-1 of
    ``group`` (default: this replica's placement group; outside one, a group of
    ``rank_bundles`` made here and removed at shutdown, bundle 0 held for this process);
    returns rank 0's engine once every rank has built its own.

    R is ``placement.num_ranks``, or ``num_ranks`` without a placement (then every rank
    places the heads with ``default_placement``). Each rank uses the first GPU of its own
    process (Ray gives each bundle's actor its GPU); CPU followers take ``cpu_threads``
    threads each (0: ``cpu_count // R``). ``admission_output_tokens``: rank 0's
    ``Engine`` keyword (tests pass 0 to force preemptions). On any failure the actors are ended
    and the process group is left before the error is raised."""
    if placement is not None:
        if num_ranks is not None and num_ranks != placement.num_ranks:
            raise ValueError(f"the placement is for {placement.num_ranks} ranks, not num_ranks={num_ranks}")
        num_ranks = placement.num_ranks
    if num_ranks is None:
        raise ValueError("num_ranks=None: give a placement or num_ranks >= 1")
    check_spec(RankSpec(config, placement, num_ranks, store_port=0))  # before anything starts
    own_group = None
    if group is None:
        group = get_current_placement_group()
    if group is None:
        own_group = group = placement_group(rank_bundles(num_ranks, gpu=_on_gpu(config)), strategy="STRICT_PACK")
    followers = RayFollowers([_rank_actor(group, rank) for rank in range(1, num_ranks)], own_group)
    try:
        if own_group is not None:
            ray.get(own_group.ready(), timeout=timeout_s)
        store = host_store(num_ranks, timeout_s)
        spec = RankSpec(config, placement, num_ranks, store.port, timeout_s, cpu_threads,
                        admission_output_tokens=admission_output_tokens)
        followers.start(spec)
    except BaseException:
        followers.stop(timeout_s=0)
        raise
    engine = start_leader(spec, store, followers)  # stops the followers if it fails
    try:
        followers.wait_started(timeout_s)
    except BaseException:
        engine.shutdown(graceful=False, timeout_s=0)
        raise
    return engine


def _rank_actor(group: PlacementGroup, rank: int) -> Any:
    """Rank ``rank``'s actor in bundle ``rank``, asking for all of that bundle's CPUs and GPUs."""
    bundle = group.bundle_specs[rank]
    return RankActor.options(
        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
    ).remote()


def _on_gpu(config: SpinConfig) -> bool:
    return resolve_device(config.model.device).type == "cuda"


def _outcome(ref) -> int | str:
    """A finished serve call: its exit code, or how the follower failed."""
    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as e:
        return f"died ({type(e).__name__})"
    except Exception as e:
        return f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
