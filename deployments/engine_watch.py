"""The planner's deployment, which sees an engine replica die within a probe interval
instead of after ``serve.engine_stale_s`` of silence.

    planner.engine_actor_names() ──probe each replica actor──▶ ActorDiedError ──▶ planner.engine_died(id)

The probe is the call Serve's own routers make to read a replica's queue length
(``get_num_ongoing_requests``). It runs on a thread of its own in the replica, so a busy
engine answers at once, and it fails as soon as Ray knows the actor is gone (at once after a
kill, a crash, or its node's removal). A probe that only times out proves nothing: a stuck
engine is left to ``engine_stale_s``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from spin_cluster.deployments.planner import ClusterPlanner
from spin_cluster.deployments.settings import AppConfig

logger = logging.getLogger(__name__)

# Serve's replica actors live in this Ray namespace.
_SERVE_NAMESPACE = "serve"
# Probe period, and how long one probe may take before the round moves on: with the period,
# the bound on how stale /health is after an engine dies.
PROBE_INTERVAL_S = 0.25
_PROBE_TIMEOUT_S = 1.0


class WatchedPlanner(ClusterPlanner):
    """``ClusterPlanner`` plus the watch, on the replica's event loop."""

    async def __init__(self, config: AppConfig) -> None:  # Serve awaits an async __init__
        super().__init__(config)
        self._watch = asyncio.get_running_loop().create_task(watch_engines(self))


async def watch_engines(planner: ClusterPlanner, interval_s: float = PROBE_INTERVAL_S) -> None:
    handles: dict[str, Any] = {}
    while True:
        names = planner.engine_actor_names()
        for rid in set(handles) - set(names):
            del handles[rid]
        probes = {}
        for rid, name in names.items():
            try:
                handles[rid] = handles.get(rid) or ray.get_actor(name, namespace=_SERVE_NAMESPACE)
            except ValueError:  # no such actor: it is dead and gone
                _died(planner, rid)
                continue
            probes[rid] = handles[rid].get_num_ongoing_requests.remote()
        results = await asyncio.gather(*(_is_dead(ref) for ref in probes.values()))
        for rid, dead in zip(probes, results):
            if dead:
                _died(planner, rid)
        await asyncio.sleep(interval_s)


async def _is_dead(probe: Any) -> bool:
    try:
        await asyncio.wait_for(probe, _PROBE_TIMEOUT_S)
    except ActorDiedError:
        return True
    except Exception:  # slow, or unreachable for now: the stale timeout decides
        return False
    return False


def _died(planner: ClusterPlanner, replica_id: str) -> None:
    logger.info("engine replica %s died; no longer routed to", replica_id)
    planner.engine_died(replica_id)
