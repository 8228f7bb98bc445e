"""Head-parallel ranks behind a server: rank 0 in the serving process, the others as
follower processes that replay its calls.

    engine = start_head_parallel(config, placement)   # rank 0 here, ranks 1..R-1 as subprocesses
    rid = engine.add_request(token_ids, params)        # checked here, queued for the followers
    outputs = engine.step()                            # queued calls + "step" go out, then rank 0 steps
    engine.dead_followers()                            # {rank: exit code} of followers that exited
    engine.shutdown()                                  # "stop", wait, terminate what is left

``HeadParallelEngine`` is SPMD: every rank must see the same ``add_request`` / ``abort`` /
``step`` calls in the same order. A server drives one engine object (the engine loop's
thread calls it), so that object is rank 0, the ``LeaderEngine``; it keeps the ``Engine``
API and forwards every call that changes scheduler state. ``generate``, ``stream`` and
``chat`` go through those three, and nothing else changes it. The calls are batched per step
and sent with ``broadcast_object_list`` over a gloo control group::

    rank 0:    add(a) add(b) abort(c) step
                 ──[("add", "a", ids, params), ("add", "b", ...), ("abort", "c"), ("step",)]──▶
    followers: apply them in order, then step: the same scheduling, hence the same collectives

Adds and aborts change only host-side state (queues, page tables), so a follower may apply
them just before the next step: every rank's step starts from the same state. An abort is
forwarded only when it did something on rank 0; on a follower the same request is in the
same state, so the abort would be a no-op there as well. Followers receive token ids (rank 0
tokenizes and validates; a refused request never reaches them) and the request id rank 0
chose, so ids, seeds and sampling line up.

Processes. Followers are ``python -m spin_cluster.parallel.serving`` subprocesses of the
serving process, not multiprocessing children: a spawn start inside a Ray worker would
re-run Ray's worker entry point. They inherit the environment, CUDA_VISIBLE_DEVICES included
(rank r uses ``cuda:r`` of the replica's GPUs, as ``launch.py``'s ranks do; on the CPU each
follower takes ``cpu_count // R`` threads). The config and placement reach them pickled on
their stdin, so nothing is written to disk.

Rendezvous. Rank 0 hosts the TCPStore on a port the OS picks (no free-port race), starts the
followers, waits until each has connected (an exited follower fails the start at once), then
every rank joins the process group (NCCL on GPU, gloo on CPU; ``timeout_s`` bounds every
collective of a step) and the gloo control group. A server can sit idle for days with the
followers blocked on their next command, so the control group's timeout is long; a follower
still leaves as soon as rank 0 is gone, because the control connection closes (and, as a
backstop, a watchdog thread exits when the follower's parent process changes).

Failures. A follower that dies makes rank 0's next broadcast or all-reduce raise, so the step
fails, and ``dead_followers`` names it (the engine server's health check). Rank 0 gone makes
every follower exit. ``shutdown`` sends "stop" (exit code 0), waits, then terminates and
reaps what is left, and leaves the process group.

Not imported by ``spin_cluster.parallel``'s ``__init__``: ``python -m`` would otherwise find
this module already imported when it runs it.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine.engine import resolve_device
from spin_cluster.engine.request import RequestOutput, SamplingParams
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.parallel.engine import HeadParallelEngine
from spin_cluster.parallel.group import backend_for

logger = logging.getLogger(__name__)

# Seconds a step's collectives (and the start: rendezvous, engine construction) may wait.
DEFAULT_TIMEOUT_S = 120.0
# The control group's: a follower waits for its next command for as long as the server idles.
_CONTROL_TIMEOUT = timedelta(days=365)
_HOST = "127.0.0.1"
_MODULE = "spin_cluster.parallel.serving"  # this module, run as each follower's main
_JOINED_KEY = "spin/follower_joined"
_POLL_S = 0.05
_WATCHDOG_S = 0.5

# Follower exit codes: told to stop, rank 0 gone; 1 is an error (with its traceback).
EXIT_STOPPED = 0
EXIT_LEADER_GONE = 3

_STEP = ("step",)
_STOP = ("stop",)


class LeaderEngine(HeadParallelEngine):
    """Rank 0 of a head-parallel engine, driven like an ``Engine``; forwards the calls that
    change scheduler state to the other ranks over ``control_group`` (all ranks, gloo).

    ``start_head_parallel`` builds one with its followers; built directly, the caller runs
    the other ranks (each with ``run_follower``) and owns the process group."""

    def __init__(
        self,
        config: SpinConfig | None = None,
        placement: HeadPlacement | None = None,
        *,
        control_group,
        group=None,
        decode_attention: str = "auto",
        progress: bool = True,
    ) -> None:
        if dist.is_initialized() and dist.get_rank(group) != 0:
            raise ValueError(f"the leader is rank 0, this process is rank {dist.get_rank(group)}")
        self._control = control_group
        self._pending: list[tuple] = []  # calls since the last step, in order
        self._followers: list[subprocess.Popen] = []  # ranks 1.. when started here
        self._owns_process_group = False
        self._store = None  # the rendezvous store, kept alive with the group
        self._stopped = False
        super().__init__(config, placement, group=group, decode_attention=decode_attention, progress=progress)

    # ---- the Engine calls that change scheduler state -----------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        request_id = super().add_request(prompt, params, request_id)  # raises before anything is queued
        req = self._requests[request_id]
        self._pending.append(("add", request_id, list(req.prompt_token_ids), req.params))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        out = super().abort(request_id)
        if out is not None:  # a no-op here is a no-op on every rank: nothing to forward
            self._pending.append(("abort", request_id))
        return out

    def step(self) -> list[RequestOutput]:
        if self._stopped:
            raise RuntimeError("the head-parallel engine has been shut down")
        dist.broadcast_object_list([[*self._pending, _STEP]], src=0, group=self._control)
        self._pending = []
        return super().step()

    # ---- followers ------------------------------------------------------------------------

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self._followers]

    def dead_followers(self) -> dict[int, int]:
        """{rank: exit code} of the follower processes that have exited (empty: all alive)."""
        return {r: p.returncode for r, p in enumerate(self._followers, start=1) if p.poll() is not None}

    def followers_alive(self) -> bool:
        return not self.dead_followers()

    def shutdown(self, *, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the followers and, when started by ``start_head_parallel``, leave the process
        group. Idempotent; the engine refuses to step afterwards.

        graceful: send "stop" first. Call it so only from the thread that steps, or once that
        thread has stopped (the control group is not shared between threads); with False the
        followers are terminated without a word. Followers still running after ``timeout_s``
        are terminated, then killed."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if graceful and self.followers_alive():
                _call_with_deadline(
                    lambda: dist.broadcast_object_list([[_STOP]], src=0, group=self._control), timeout_s
                )
            _stop_processes(self._followers, timeout_s)
        finally:
            if self._owns_process_group and dist.is_initialized():
                self.release_cuda_graphs()
                dist.destroy_process_group()
            self._store = None


def start_head_parallel(
    config: SpinConfig,
    placement: HeadPlacement | None = None,
    *,
    num_ranks: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cpu_threads: int | None = None,
    decode_attention: str = "auto",
    progress: bool = False,
) -> LeaderEngine:
    """Rank 0 in this process, ranks 1 .. R-1 as follower subprocesses; returns rank 0's
    engine once every rank has built its own.

    R is ``placement.num_ranks``, or ``num_ranks`` without a placement (then every rank
    places the heads with ``default_placement``). This process joins torch.distributed's
    default group as rank 0 (it must not be in one yet) and leaves it in ``shutdown``. On
    CUDA rank r uses ``cuda:r``; on the CPU followers take ``cpu_threads`` threads each
    (default ``cpu_count // R``), and this process keeps its own setting. On any failure the
    followers are stopped and the group is left before the error is raised."""
    if placement is not None:
        if num_ranks is not None and num_ranks != placement.num_ranks:
            raise ValueError(f"the placement is for {placement.num_ranks} ranks, not num_ranks={num_ranks}")
        num_ranks = placement.num_ranks
    if num_ranks is None or num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}: give a placement or num_ranks >= 1")
    if dist.is_initialized():
        raise ValueError("this process is already in a torch.distributed process group")
    refusal = config.head_parallel_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    device = resolve_device(config.model.device)
    if device.type == "cuda":
        if torch.cuda.device_count() < num_ranks:
            raise ValueError(f"{num_ranks} ranks need {num_ranks} GPUs, this process sees {torch.cuda.device_count()}")
        torch.cuda.set_device(0)
        leader_config = config.replace(model={"device": "cuda:0"})
    else:
        leader_config = config
    threads = cpu_threads or max(1, (os.cpu_count() or 1) // num_ranks)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(_HOST, 0, num_ranks, is_master=True, wait_for_workers=False, timeout=timeout)
    spec = pickle.dumps({"config": config, "placement": placement})
    followers: list[subprocess.Popen] = []
    try:
        for rank in range(1, num_ranks):
            followers.append(subprocess.Popen(
                [sys.executable, "-m", _MODULE, "--rank", str(rank), "--world-size", str(num_ranks),
                 "--port", str(store.port), "--leader-pid", str(os.getpid()),
                 "--timeout-s", str(timeout_s), "--threads", str(threads)],
                stdin=subprocess.PIPE,
            ))
        for proc in followers:
            _hand_over(proc, spec)
        _wait_joined(store, followers, timeout_s)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=num_ranks, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
        engine = LeaderEngine(leader_config, placement, control_group=control,
                              decode_attention=decode_attention, progress=progress)
    except BaseException:
        _stop_processes(followers, timeout_s=1.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    engine._followers = followers
    engine._owns_process_group = True
    engine._store = store
    return engine


def run_follower(engine: HeadParallelEngine, control_group) -> int:
    """Apply rank 0's calls to ``engine`` in order until "stop" (EXIT_STOPPED) or until rank
    0 is gone (EXIT_LEADER_GONE: the control broadcast failed)."""
    while True:
        box: list = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control_group)
        except Exception as e:  # the connection to rank 0 closed: it exited or was killed
            logger.warning("rank %d: rank 0 is gone (%s); exiting", engine.rank, _first_line(e))
            return EXIT_LEADER_GONE
        for command in box[0]:
            kind = command[0]
            if kind == "add":
                _, request_id, token_ids, params = command
                engine.add_request(token_ids, params, request_id=request_id)
            elif kind == "abort":
                engine.abort(command[1])
            elif kind == "step":
                engine.step()
            elif kind == "stop":
                return EXIT_STOPPED
            else:
                raise ValueError(f"unknown command {kind!r} from rank 0")


def main(argv: Sequence[str] | None = None) -> int:
    """A follower rank: ``python -m spin_cluster.parallel.serving --rank R ...``, with
    {"config": SpinConfig, "placement": HeadPlacement | None} pickled on stdin (or in the
    file ``--spec``). Started by ``start_head_parallel``."""
    parser = argparse.ArgumentParser(prog="python -m spin_cluster.parallel.serving",
                                     description="A follower rank of a head-parallel engine.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's TCPStore port")
    parser.add_argument("--host", default=_HOST)
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: cpu_count // world size)")
    parser.add_argument("--leader-pid", type=int, default=None,
                        help="exit when the parent process is no longer this one")
    parser.add_argument("--spec", default="-", help="pickled config and placement: a file, or - for stdin")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    if args.spec == "-":
        spec = pickle.loads(sys.stdin.buffer.read())
    else:
        with open(args.spec, "rb") as f:
            spec = pickle.load(f)
    if args.leader_pid is not None:
        _watch_parent(args.leader_pid)

    config: SpinConfig = spec["config"]
    device = resolve_device(config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(args.rank)
        config = config.replace(model={"device": f"cuda:{args.rank}"})
    else:  # share the cores instead of oversubscribing them
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.world_size))
    timeout = timedelta(seconds=args.timeout_s)
    store = dist.TCPStore(args.host, args.port, args.world_size, is_master=False, timeout=timeout)
    store.set(f"{_JOINED_KEY}/{args.rank}", str(os.getpid()))
    dist.init_process_group(backend_for(device), store=store, rank=args.rank, world_size=args.world_size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    try:
        engine = HeadParallelEngine(config, spec["placement"], progress=False)
        code = run_follower(engine, control)
    except Exception as e:
        if args.leader_pid is not None and os.getppid() != args.leader_pid:
            logger.warning("rank %d: rank 0 is gone (%s); exiting", args.rank, _first_line(e))
            return EXIT_LEADER_GONE
        raise  # a real failure: the traceback goes to stderr, and rank 0's next collective fails
    if code == EXIT_STOPPED:
        engine.release_cuda_graphs()
        dist.destroy_process_group()
    return code


# ---- helpers --------------------------------------------------------------------------------


def _hand_over(proc: subprocess.Popen, spec: bytes) -> None:
    """Write the pickled spec to a follower's stdin and close it; a follower that already
    exited is reported by ``_wait_joined``."""
    try:
        proc.stdin.write(spec)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _wait_joined(store, followers: list[subprocess.Popen], timeout_s: float) -> None:
    """Until every follower has reached the store; raises at once if one exited."""
    keys = [f"{_JOINED_KEY}/{rank}" for rank in range(1, len(followers) + 1)]
    deadline = time.monotonic() + timeout_s
    while keys and not store.check(keys):
        dead = {r: p.returncode for r, p in enumerate(followers, start=1) if p.poll() is not None}
        if dead:
            raise RuntimeError(f"head-parallel follower ranks exited while starting (rank: exit code): {dead}; "
                               "see their stderr")
        if time.monotonic() > deadline:
            raise TimeoutError(f"head-parallel follower ranks did not connect within {timeout_s}s")
        time.sleep(_POLL_S)


def _stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every process to exit, then terminate, then kill; all reaped."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _call_with_deadline(fn, timeout_s: float) -> None:
    """Run ``fn`` on a daemon thread for at most ``timeout_s`` seconds (a stuck peer cannot
    hold the caller); errors are logged, not raised."""

    def run() -> None:
        try:
            fn()
        except Exception as e:
            logger.warning("could not tell the followers to stop: %s", _first_line(e))

    thread = threading.Thread(target=run, name="head-parallel-stop", daemon=True)
    thread.start()
    thread.join(timeout_s)


def _watch_parent(leader_pid: int) -> None:
    """Exit (EXIT_LEADER_GONE) as soon as this process's parent is no longer rank 0's process."""

    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(_WATCHDOG_S)
        logger.warning("rank 0's process %d is gone; exiting", leader_pid)
        os._exit(EXIT_LEADER_GONE)

    threading.Thread(target=watch, name="leader-watchdog", daemon=True).start()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


if __name__ == "__main__":
    sys.exit(main())
