"""What rank 0 sends its workers each step: ``StepPlan``, and ``RecordedKV``, which collects
its cache calls.

A worker's cache must hold the same pages for the same requests as rank 0's (its heads'
share of them), since the step's page tables are built from it. Rank 0's scheduler is the only
one that decides, so rank 0 records every call its scheduler makes that changes which pages a
request holds, in order, and a worker makes the same calls on its own cache (of the same
capacity in token pages) before the step's forward::

    rank 0:   allocate(a, 8)  commit(a, 8)  free(b)  allocate(c, 16, prefix)   ┐ step n
                ──StepPlan(ops=[("allocate", "a", 8, 0, ()), ..., ("allocate", "c", 16, 1, ids)],
                           chunks=[("a", 8, 1, True, [42]), ("c", 8, 8, False, [...])])──▶
    worker:   the same calls, then the forward of the chunks

A prefix hit holds the cache's own page handles, which mean nothing in another process; the
plan carries the token ids the hit covers instead, and the worker looks them up in its own
cache, which holds the same pages (a different answer there is an error: the caches diverged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit

# What rank 0 sends in place of a plan to end its workers' loop.
STOP = "stop"

# A cache call: ("allocate", request id, tokens, requests queued, the prefix hit's token ids),
# ("commit", request id, tokens) or ("free", request id).
CacheCall = tuple


@dataclass(frozen=True)
class StepPlan:
    """One step of rank 0's schedule, as a worker runs it."""

    ops: tuple[CacheCall, ...]  # rank 0's cache calls since the last plan, in order
    # (request id, start, number of tokens, is decode, their token ids) of each chunk, in the
    # batch's order
    chunks: tuple[tuple[str, int, int, bool, list[int]], ...]

    @classmethod
    def of(cls, ops: Sequence[CacheCall], chunks: Sequence[ScheduledChunk]) -> StepPlan:
        return cls(tuple(ops), tuple(
            (c.request.request_id, c.start, c.num_tokens, c.is_decode, c.request.token_ids(c.start, c.start + c.num_tokens))
            for c in chunks))


class RecordedKV:
    """Rank 0's cache as its scheduler sees it: ``allocate``, ``commit`` and ``free`` go to the
    cache and are recorded; everything else is the cache's own. (A wrapper rather than a
    ``KVCache`` subclass: it must stay in front of either cache kind.)"""

    def __init__(self, kv: KVCache) -> None:
        self._kv = kv
        self._ops: list[CacheCall] = []
        self._hit: tuple[PrefixHit, list[int]] = (NO_PREFIX, [])  # the last hit and the tokens it covers

    def __getattr__(self, name: str):
        return getattr(self._kv, name)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        hit = self._kv.match_prefix(token_ids)
        if hit.num_tokens:
            self._hit = (hit, list(token_ids[: hit.num_tokens]))
        return hit

    def allocate(self, request_id: str, num_tokens: int, num_queued: int = 0, prefix: PrefixHit = NO_PREFIX) -> None:
        self._kv.allocate(request_id, num_tokens, num_queued, prefix)
        prefix_ids: list[int] = []
        if prefix.num_tokens:
            hit, prefix_ids = self._hit
            if hit is not prefix:  # the scheduler admits with the hit it has just matched
                raise RuntimeError(f"request {request_id!r} was allocated a prefix hit that match_prefix did not give")
        self._ops.append(("allocate", request_id, num_tokens, num_queued, prefix_ids))

    def commit(self, request_id: str, num_tokens: int, token_ids: Callable[[int, int], list[int]]) -> None:
        self._kv.commit(request_id, num_tokens, token_ids)
        self._ops.append(("commit", request_id, num_tokens))

    def free(self, request_id: str) -> None:
        if self._kv.has(request_id):  # (a waiting request's free is a no-op on every rank)
            self._kv.free(request_id)
            self._ops.append(("free", request_id))

    def take(self) -> list[CacheCall]:
        """The calls recorded since the last ``take``, oldest first."""
        ops, self._ops = self._ops, []
        return ops
