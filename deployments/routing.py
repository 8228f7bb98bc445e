"""The request router of ``EngineServer``: send each request where the planner said.

The ingress asks the planner for a replica id and passes it as ``route_to=`` on the
``generate`` call. Serve hands this router the pending request; the router ranks that
replica first and the others after it, so a pick that has died or is full falls back to
the rest instead of failing. Calls without a pick (checks, stats) may go anywhere.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTE_KWARG = "route_to"


class PlannerRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return rank_replicas(candidate_replicas, _target(pending_request))


def rank_replicas(replicas: list[RunningReplica], target: str | None) -> list[list[RunningReplica]]:
    picked = [r for r in replicas if target is not None and r.replica_id.unique_id == target]
    if not picked:
        return [list(replicas)] if replicas else []
    return [picked, [r for r in replicas if r not in picked]]


def _target(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return (pending_request.kwargs or {}).get(ROUTE_KWARG)
