"""Ranks 1..R-1 of a head-parallel engine: workers that run rank 0's schedule.

    worker = RankWorker(cfg, placement)     # joins nothing: the process groups exist already
    code = worker.serve(control_group)      # plans until rank 0 says stop (or is gone)

A worker holds its shard of the model, its heads' KV cache and a model runner, and nothing
that decides: each ``StepPlan`` from rank 0 (``spin_cluster.parallel.plan``) gives the cache
calls rank 0's scheduler made and the step's chunks with their token ids; the worker makes
the calls on its own cache and runs the forward, whose collectives meet rank 0's. It computes
no logits (rank 0 samples from the same all-reduced ones) and keeps, of each request, only its
id and the token ids it has been sent (what the runner and the prefix cache read).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine.stack import build_stack
from spin_cluster.engine.request import SamplingParams
from spin_cluster.engine.scheduler import ScheduledChunk
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.kvcache.base import NO_PREFIX
from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy
from spin_cluster.parallel.engine import (
    build_rank_cache,
    check_rank,
    load_rank_model,
    release_cuda_graphs,
)
from spin_cluster.parallel.plan import STOP, StepPlan

logger = logging.getLogger(__name__)

# What ``serve`` returns: told to stop, or rank 0 gone.
EXIT_STOPPED = 0
EXIT_LEADER_GONE = 3


class _Tokens:
    """A request as a worker knows it: its id and its token ids so far (the chunks' and a
    prefix hit's). Its params ask for no prompt logprobs: a worker scores nothing."""

    __slots__ = ("ids", "request_id")
    params = SamplingParams()

    def __init__(self, request_id: str, ids: list[int]) -> None:
        self.request_id = request_id
        self.ids = ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        return self.ids[start:stop]

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


class RankWorker:
    """Rank ``dist.get_rank(group)`` >= 1, built as rank 0 builds its engine, by the same
    ``engine.stack.build_stack`` (the same collectives, in the same order: the model's sharding,
    the cache's sizing; the decode graphs captured alike)."""

    def __init__(self, config: SpinConfig, placement: HeadPlacement | None = None, *, group=None,
                 decode_attention: str = "auto", buffer_policy: BufferPolicy = DEFAULT_POLICY) -> None:
        self.rank, self.num_ranks = check_rank(config, placement, group)
        if self.rank == 0:
            raise ValueError("rank 0 schedules: it runs a HeadParallelEngine, not a RankWorker")
        self.config = config
        self.placement = placement

        def load(path, dtype, device):
            model, self.placement = load_rank_model(config, path, self.placement, self.rank, self.num_ranks, dtype,
                                                    device, progress=False, group=group)
            return model

        def cache(model, dtype, device, max_model_len):
            return build_rank_cache(config, model.config, self.placement, self.rank, dtype, device, max_model_len,
                                    decode_attention, buffer_policy, group)

        # rank 0's build (``HeadParallelEngine``, an ``Engine``) goes through the same function
        stack = build_stack(config, load, cache, progress=False)
        self.device, self.model, self.kv, self.attention = stack.device, stack.model, stack.kv, stack.attention
        self.runner = stack.runner
        self._requests: dict[str, _Tokens] = {}
        self.num_plans_run = 0

    def serve(self, control_group) -> int:
        """Run rank 0's plans in order until it sends STOP (EXIT_STOPPED) or is gone
        (EXIT_LEADER_GONE: the control broadcast failed). An error in a plan raises."""
        while True:
            box: list = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=control_group)
            except Exception as e:  # the connection to rank 0 closed: it exited or was killed
                logger.warning("rank %d: rank 0 is gone (%s); exiting", self.rank, first_line(e))
                return EXIT_LEADER_GONE
            if box[0] == STOP:
                return EXIT_STOPPED
            self.run(box[0])

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> None:
        """Rank 0's cache calls on this rank's cache, then the step's forward."""
        for op in plan.ops:
            self._apply(op)
        self.runner.execute(self._chunks(plan), logits=False)
        self.num_plans_run += 1

    def _chunks(self, plan: StepPlan) -> list[ScheduledChunk]:
        """The plan's chunks over this worker's requests, their tokens taken in."""
        chunks = []
        for request_id, start, num_tokens, is_decode, tokens in plan.chunks:
            req = self._requests[request_id]
            del req.ids[start:]  # (nothing past a chunk's start is computed)
            req.ids.extend(tokens)
            chunks.append(ScheduledChunk(req, start, num_tokens, is_decode))
        return chunks

    def _apply(self, op: tuple) -> None:
        kind, request_id = op[0], op[1]
        if kind == "allocate":
            _, _, num_tokens, num_queued, prefix_ids = op
            self._requests.setdefault(request_id, _Tokens(request_id, list(prefix_ids)))
            prefix = NO_PREFIX
            if prefix_ids:
                prefix = self.kv.match_prefix(prefix_ids)
                if prefix.num_tokens != len(prefix_ids):
                    raise RuntimeError(f"rank {self.rank}'s cache holds {prefix.num_tokens} tokens of request "
                                       f"{request_id!r}'s prefix, rank 0's {len(prefix_ids)}: the caches diverged")
            self.kv.allocate(request_id, num_tokens, num_queued, prefix)
        elif kind == "commit":
            self.kv.commit(request_id, op[2], self._requests[request_id].token_ids)
        elif kind == "free":
            self.kv.free(request_id)
            self._requests.pop(request_id, None)
        else:
            raise ValueError(f"unknown cache call {kind!r} from rank 0")

    def check_integrity(self) -> None:
        """Raises AssertionError unless the cache is sound and holds pages of known requests only."""
        self.kv.check_integrity()
        unknown = set(self.kv.request_ids()) - set(self._requests)
        if unknown:
            raise AssertionError(f"rank {self.rank} holds pages of requests rank 0 has not sent: {sorted(unknown)}")

    def release_cuda_graphs(self) -> None:
        """``spin_cluster.parallel.engine.release_cuda_graphs``: before leaving the process group."""
        release_cuda_graphs(self.runner, self.device)


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
