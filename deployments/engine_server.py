"""``EngineServer``: one replica per node, wrapping that node's ``Engine``.

With more than one head-parallel rank in the planner's plan (``serve.engine_ranks``, by
default one per GPU of the replica), the engine is rank 0 of a head-parallel engine
(``spin_cluster.parallel.serving.LeaderEngine``) over the node's GPUs (or CPU processes):
ranks 1.. are Ray actors in the replica's placement group that replay rank 0's calls, each
owning the KV heads the planner placed on it (``head_parallel.py``). It keeps the ``Engine``
API, so the engine loop and everything below are the same for one rank or many. A follower
that ends makes the health check fail (Serve replaces the replica); the replica's shutdown
ends them.

    ingress ──generate(GenerateRequest)──▶ [validate, queue limit] ──submit──▶ EngineLoop thread
    ingress ◀──Admitted | Failed, Delta...── asyncio.Queue ◀──sink (call_soon_threadsafe)──┘

The engine runs on the loop's own thread (``engine_loop.py``); this class only validates,
applies the queue limit, relays outputs and reports to the planner. A stream that is closed
or cancelled before its request finished (the client went away) aborts the request, which
frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from spin_cluster.deployments.engine_loop import EngineLoop
from spin_cluster.deployments.engine_stats import engine_report
from spin_cluster.deployments.messages import Admitted, Delta, EnginePlan, EngineReport, Failed, GenerateRequest
from spin_cluster.deployments.settings import AppConfig
from spin_cluster.deployments.tool_calls import template_input

logger = logging.getLogger(__name__)

# Helpers sit above the deployment class: Serve serializes the class when it is decorated,
# with the module globals defined by then.


class _Prompt:
    """Text, token ids or chat messages (with the tools the template lists); turned into ids
    on the engine's thread, where the tokenizer lives (it is not safe to share between threads)."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request

    def token_ids(self, engine: Any) -> list[int]:
        r = self.request
        if r.messages is not None:
            messages, tools = template_input([dict(m) for m in r.messages], [dict(t) for t in r.tools or ()] or None,
                                             engine.tokenizer.template_lists_tools())
            return engine.tokenizer.chat_prompt_ids(messages, tools)
        if r.prompt is not None:
            return engine.tokenizer.encode(r.prompt)
        return [int(t) for t in r.prompt_token_ids]

    def text(self, engine: Any, ids: list[int]) -> str | None:
        """The prompt's text, for ``echo``: as sent, or its token ids decoded."""
        if not self.request.echo:
            return None
        return self.request.prompt if self.request.prompt is not None else engine.tokenizer.decode(ids)


def _sampling_params(fields: dict[str, Any], n: int) -> list[Any]:
    """Each choice's SamplingParams: with a seed, choice i draws from seed + i (as vLLM), so
    that the choices differ and each is reproducible."""
    from spin_cluster.engine import SamplingParams

    seed = fields.get("seed")
    return [SamplingParams(**{**fields, "seed": None if seed is None else seed + i}) for i in range(n)]


def _choice_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def _coalesce(item: object, queue: asyncio.Queue) -> tuple[object, object | None]:
    """``item`` with the Deltas already queued behind it, as one Delta, and the first
    non-Delta item taken from the queue on the way (None if none). When the consumer is
    slower than the steps (a loaded host, many streams), one hop to the ingress then carries
    every token that is ready instead of one each: an adaptive stream interval."""
    if not isinstance(item, Delta) or item.finished:
        return item, None
    parts = [item]
    while not parts[-1].finished and not queue.empty():
        nxt = queue.get_nowait()
        if not isinstance(nxt, Delta) or nxt.index != item.index:
            return _merge(parts), nxt
        parts.append(nxt)
    return _merge(parts), None


def _merge(deltas: list[Delta]) -> Delta:
    """Consecutive Deltas of one choice as one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(text="".join(d.text for d in deltas), token_ids=tuple(t for d in deltas for t in d.token_ids),
                 finished=last.finished, finish_reason=last.finish_reason, index=last.index,
                 logprobs=tuple(lp for d in deltas for lp in d.logprobs),
                 prompt_logprobs=deltas[0].prompt_logprobs)


def _param_of(message: str) -> str | None:
    """SamplingParams messages start with 'name=value'."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


def _huge_pages_mb() -> float | None:
    """This process's anonymous memory on transparent huge pages, in MB (None off Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return 0.0


def _build_engine(spin: Any, plan: EnginePlan, timeout_s: float, torch_threads: int | None = None,
                  step_threads: Any = None, warmup: bool | None = None) -> Any:
    """The plain ``Engine`` for a one-rank plan, on ``torch_threads`` threads (None: as the
    process has them), or per step by ``step_threads`` (a ``StepThreads``) once it runs, warmed
    up (``ServeOptions.warmup``; None: on CUDA); else rank 0 of a head-parallel engine with the
    plan's placement, its other ranks started as Ray actors in this replica's placement group
    (each sets its own threads)."""
    ranks = len(plan.head_placement) if plan.head_placement else 1
    if ranks == 1:
        import torch

        from spin_cluster.engine import Engine

        # The engine times its small-row GEMMs at start on this thread's count: that of the
        # small steps when step_threads picks per step.
        threads = step_threads.small if step_threads is not None else torch_threads
        if threads is not None:
            torch.set_num_threads(threads)
        engine = Engine(spin, progress=False)
        if warmup or (warmup is None and engine.device.type == "cuda"):
            t0, lengths = time.monotonic(), engine.warm_lengths()
            logger.info("warming the engine up before it takes requests: prompts of %s tokens", lengths)
            engine.warm_up(lengths)
            logger.info("engine warm in %.1f s", time.monotonic() - t0)
        if engine.device.type == "cpu":
            engine.runner.step_threads = step_threads
        return engine
    from spin_cluster.deployments.head_parallel import start_head_parallel
    from spin_cluster.hplb.placement import HeadPlacement

    placement = HeadPlacement.from_rank_heads(plan.head_placement)
    return start_head_parallel(spin, placement, timeout_s=timeout_s)


@serve.deployment(name="EngineServer")
class EngineServer:
    async def __init__(self, config: AppConfig, planner: DeploymentHandle) -> None:
        self._serve = config.serve
        self._planner = planner
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        plan = await planner.register.remote(self.replica_id, ray.get_runtime_context().get_actor_name())
        spin = config.spin.replace(sparse=plan.sparse)
        # A step's collectives may wait as long as a request may wait for its next token.
        self._engine = await asyncio.to_thread(_build_engine, spin, plan, self._serve.token_timeout_s,
                                               self._serve.torch_threads(), self._serve.step_threads(),
                                               self._serve.warmup)
        try:
            self._loop = EngineLoop(self._engine, idle_wait_s=self._serve.stats_interval_s)
            self._report: EngineReport = engine_report(self._engine, self.replica_id)
            self._report_s = 0.0
            self._report_counts = (0, 0)
            self._loop.on_step(self._refresh_report)
            self._loop.start()
        except BaseException:  # Serve calls __del__ only once __init__ has returned
            self._shutdown_engine(graceful=True)
            raise
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    # ---- requests ----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, route_to: str | None = None) -> AsyncIterator[object]:
        """Admitted or Failed first, then Deltas until each of the n choices has finished (or
        one Failed). The choices are requests of their own, the later ones admitted once the
        first one's prompt is in the cache. ``route_to`` is the planner's pick, read by the
        request router; the replica itself ignores it."""
        try:
            params = _sampling_params(request.sampling, request.n)
        except ValueError as e:
            yield Failed(400, str(e), param=_param_of(str(e)), code="invalid_value")
            return
        if self._loop.num_queued() >= self._serve.max_waiting_requests:
            yield Failed(429, f"the engine's queue is full ({self._serve.max_waiting_requests} requests "
                         "waiting); retry later", code="queue_full")
            return
        outputs: asyncio.Queue[object] = asyncio.Queue()
        choice_ids = _choice_ids(request.request_id, request.n)
        self._submit(request, choice_ids, params, outputs)
        num_admitted = num_finished = 0
        done = failed = False
        held: object | None = None  # taken from the queue while coalescing, not yet sent
        try:
            while not (done or failed):
                item, held = _coalesce(held if held is not None else await outputs.get(), outputs)
                num_finished += isinstance(item, Delta) and item.finished
                num_admitted += isinstance(item, Admitted)
                done, failed = num_finished == len(choice_ids), isinstance(item, Failed)
                if not isinstance(item, Admitted) or num_admitted == 1:  # one Admitted for all
                    yield item
        finally:
            if not done:  # closed or cancelled early (the client is gone), or a choice failed
                for choice_id in choice_ids:  # (a no-op for one that ended)
                    self._loop.abort(choice_id)

    def _submit(self, request: GenerateRequest, choice_ids: list[str], params: list[Any],
                outputs: asyncio.Queue) -> None:
        """Each choice into the engine loop, its items into ``outputs`` tagged with its index."""
        loop = asyncio.get_running_loop()
        for i, (choice_id, p) in enumerate(zip(choice_ids, params)):
            def sink(item: object, i: int = i) -> None:
                if isinstance(item, Delta) and i:
                    item = dataclasses.replace(item, index=i)
                loop.call_soon_threadsafe(outputs.put_nowait, item)

            self._loop.submit(choice_id, _Prompt(request), p, sink, prefill_after=choice_ids[0] if i else None)

    async def end_streams(self, route_to: str | None = None) -> None:
        """Shutting down: every request here ends now with a 503 ``shutting_down`` (an error
        event on a stream), so that Serve's graceful shutdown does not wait them out.
        ``route_to``: this replica's id, so that the caller reaches each replica in turn."""
        self._loop.fail_all(Failed(503, "the server is shutting down", code="shutting_down"))

    # ---- checks and debugging -----------------------------------------------------------

    async def check_integrity(self) -> dict[str, Any]:
        """Runs the engine's own check between steps; raises if pages leaked or doubled."""

        def check(engine: Any) -> dict[str, Any]:
            engine.check_integrity()
            return {
                "replica_id": self.replica_id,
                "num_free_pages": engine.kv.num_free_pages,
                "num_total_pages": engine.kv.num_total_pages,
                "num_running": engine.scheduler.num_running(),
                "num_waiting": engine.scheduler.num_waiting(),
            }

        return await asyncio.wait_for(asyncio.wrap_future(self._loop.call(check)), self._serve.handle_timeout_s)

    def replica_info(self) -> dict[str, Any]:
        """This replica's id and Ray actor name (what an operator passes to ``ray.kill``), its
        process id, the process ids of its head-parallel follower ranks (none with one rank),
        its nice value and torch threads (with "auto", the per-step policy in step_threads), and
        the MB of its memory on transparent huge pages (``THP_MEM_ALLOC_ENABLE``)."""
        import torch

        return {"replica_id": self.replica_id, "actor_name": ray.get_runtime_context().get_actor_name(),
                "pid": os.getpid(), "follower_pids": list(getattr(self._engine, "follower_pids", [])),
                "niceness": os.nice(0), "torch_threads": torch.get_num_threads(),
                "step_threads": repr(getattr(getattr(self._engine, "runner", None), "step_threads", None)),
                "huge_pages_mb": _huge_pages_mb()}

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        if not self._loop.is_alive():
            raise RuntimeError("the engine loop thread has stopped")
        if self._loop.failure is not None:
            raise RuntimeError(f"an engine step failed: {self._loop.failure}")
        dead = getattr(self._engine, "dead_followers", dict)()
        if dead:
            raise RuntimeError(f"head-parallel follower ranks exited (rank: exit code or cause): {dead}")

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop(timeout_s=1.0)
        # "stop" goes over the control group only once the loop thread, its user, has ended.
        self._shutdown_engine(graceful=loop is None or not loop.is_alive())

    def _shutdown_engine(self, graceful: bool) -> None:
        shutdown = getattr(getattr(self, "_engine", None), "shutdown", None)
        if shutdown is not None:  # a head-parallel engine: stop its follower ranks
            shutdown(graceful=graceful, timeout_s=2.0)

    # ---- reports ------------------------------------------------------------------------

    def _refresh_report(self, engine: Any) -> None:
        """Busy, at most twice per report period (a step may take milliseconds) and whenever a
        request starts or stops running (a step may also take seconds: a long prefill, a loaded
        host); idle, every time, so that the state an abort or a last step leaves is in the next
        report."""
        now = time.monotonic()
        counts = (self._loop.num_running, self._loop.num_waiting)
        if (not engine.has_unfinished() or counts != self._report_counts
                or now - self._report_s >= self._serve.stats_interval_s / 2):
            self._report = engine_report(engine, self.replica_id, self._loop.num_admitted_total)
            self._report_s = now
            self._report_counts = counts

    async def _report_forever(self) -> None:
        while True:
            try:
                # Stamped when sent: the planner's staleness is about the engine being silent,
                # not about a step (a long prefill) keeping its state from being re-read.
                report = dataclasses.replace(self._report, reported_s=time.time())
                await asyncio.wait_for(self._planner.report.remote(report), self._serve.handle_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("could not report to the planner", exc_info=True)
            await asyncio.sleep(self._serve.stats_interval_s)

