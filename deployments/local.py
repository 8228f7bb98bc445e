"""Local mode: start Ray on this machine, run the app, block until SIGINT/SIGTERM, shut down.

    check    the config and the memory plan (preflight.py): exit 2, before Ray starts
    start    ray.init, serve.start
    deploy   serve.run; a replica that fails to start START_ATTEMPTS times fails the deploy
             (Serve's own count): its reason on stderr, exit 1
    serve    until a signal: SIGINT stops at once (streams end with an error event);
             SIGTERM drains first (503 to new requests, serve.drain_s for those in flight)
    stop     ray.shutdown; SIGINT or SIGTERM ends any state within 5 s (signals.py)

What ``spin-cluster serve`` runs. No dashboard; Ray's usage reporting is off, so nothing
leaves the machine. Ray binds to the address the API is served on: with a loopback host (the
default, 127.0.0.1) the GCS, the raylet, the object manager, every worker's gRPC server and
the node's agents listen on 127.0.0.1 only; ``--host 0.0.0.0`` opens the API, and Ray then
takes the machine's address as it would by itself.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from spin_cluster.deployments.settings import START_ATTEMPTS
from spin_cluster.deployments.signals import Interrupted, ServeSignals

if TYPE_CHECKING:
    from spin_cluster.deployments.settings import AppConfig

# Ray's logical CPUs in local mode: actors reserve fractions of these, not real cores, so
# a small machine still fits the ingress, the planner and an engine.
LOCAL_NUM_CPUS = 8
# Named for its use on Windows and macOS, where it is off by default; see run_local.
_RAY_KEEPS_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# How long the ingress gets to write the streams' error events before the cluster stops.
_ERROR_EVENT_GRACE_S = 0.5
# A drain's calls to the ingress, and how often it asks what is left.
_CALL_TIMEOUT_S = 2.0
_DRAIN_POLL_S = 0.1


def _ray_node_ip(host: str) -> str | None:
    """The address Ray's node binds to for an API served on ``host``: that address, loopback
    for ``localhost``, and None (Ray's own choice) for a wildcard such as 0.0.0.0."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--host {host!r}: give an IP address (127.0.0.1, 0.0.0.0, or one of this "
                         "machine's) or localhost") from None
    return None if address.is_unspecified else host


def serve_grpc_on_loopback() -> None:
    """Set-up hook of every Ray worker when Ray runs on loopback. Each Serve replica opens a
    gRPC server for calls between deployments on "[::]:0", every interface, whatever the node
    address, and Serve has no setting for it; this makes that address 127.0.0.1. Should a
    Ray release rename the function, the loopback test (test_local_listeners.py) fails."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server

    def bind_on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0") else address)

    replica.add_port_to_grpc_server = bind_on_loopback


def run_local(args: dict[str, Any], *, host: str = "127.0.0.1", port: int = 8000, app_name: str = "spin") -> int:
    """Runs the app until SIGINT or SIGTERM; returns the command's exit status: 0 after a
    stop while serving, 1 when the app failed to deploy, 128 + the signal when one came
    before the app served (``signals.py``)."""
    from spin_cluster.deployments.preflight import check_local_run
    from spin_cluster.deployments.settings import load_app_config

    # Bad settings, or settings the model or this machine cannot run, fail here: before Ray
    # (or even its import) starts, so the reason is the one line the user sees.
    config = load_app_config(args)
    num_cpus = max(LOCAL_NUM_CPUS, os.cpu_count() or 1)
    check_local_run(config, num_cpus)
    _set_ray_environment(host)
    import ray

    signals = ServeSignals()
    signals.install()
    try:
        return _run(config, signals, num_cpus=num_cpus, host=host, port=port, app_name=app_name)
    except Interrupted as stopped:
        print(f"stopped by {stopped} before the app served", flush=True)
        return 128 + stopped.signum
    except SystemExit as stopped:  # SIGTERM inside ray.init, whose own handler exits with the signal
        print(f"stopped by signal {stopped.code} while Ray started", flush=True)
        return 128 + signal.SIGTERM
    finally:
        # Not serve.shutdown(): it waits out each replica's graceful shutdown in turn (~25 s).
        # The streams have ended (_stop); stopping the cluster this process started stops
        # every process of it, replicas included.
        t1 = time.monotonic()
        ray.shutdown()
        print(f"cluster stopped in {time.monotonic() - t1:.2f} s", flush=True)
        signals.restore()


def _set_ray_environment(host: str) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at nice 15: the engine would yield the CPU to any other process
    # (the load client included). Read by the raylet from the environment.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # torch's CPU allocator backs allocations of 2 MB and more with transparent huge pages
    # (where the kernel's THP mode is `madvise`, the default of many distributions): a CPU
    # engine's decode step reads every weight and every KV page once, and with 4 KB pages a
    # KV page (16 tokens of one head) is one TLB miss of its own. Inherited by the workers.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    node_ip = _ray_node_ip(host)
    if node_ip is not None and ipaddress.ip_address(node_ip).is_loopback:  # and serve_grpc_on_loopback
        # On Linux Ray replaces a loopback node address with the machine's own and then binds
        # its gRPC servers to every interface; with this off it keeps the loopback address,
        # and its servers and agents bind to it. Read when Ray is imported, and inherited by
        # the processes it starts.
        os.environ[_RAY_KEEPS_LOOPBACK_ENV] = "0"


def _run(config: AppConfig, signals: ServeSignals, *, num_cpus: int, host: str, port: int, app_name: str) -> int:
    import ray
    from ray import serve

    from spin_cluster.deployments.app import build_app

    node_ip = _ray_node_ip(host)
    # A new single-machine cluster whose own services listen on node_ip (above).
    loopback = node_ip is not None and ipaddress.ip_address(node_ip).is_loopback
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _node_ip_address=node_ip,
             runtime_env={"worker_process_setup_hook": f"{__name__}.serve_grpc_on_loopback"} if loopback else None)
    signals.install()  # ray.init set its own SIGTERM handler
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_app(config), name=app_name, route_prefix="/")
    except Interrupted:
        # serve.run returns a moment after the app is up (it waits for the proxies too), and
        # /health answers meanwhile: a signal then is a stop of a serving app.
        app = serve.status().applications.get(app_name)
        if app is None or app.status != "RUNNING":
            raise
    except RuntimeError:  # Serve's DEPLOY_FAILED: a replica failed to start START_ATTEMPTS times
        print(f"error: {deploy_failure(app_name)}", file=sys.stderr, flush=True)
        return 1
    signals.serving()
    print(f"serving {config.model_name} on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    signals.stop.wait()
    _stop(app_name, signals, config.serve.drain_s)
    return 0


def deploy_failure(app_name: str) -> str:
    """Why Serve gave up on the app (``failure_message`` of its status)."""
    from ray import serve

    return failure_message(serve.status().applications.get(app_name))


def failure_message(app: Any) -> str:
    """Why Serve gave up on an app, from its status (an ApplicationStatusOverview, or None):
    each failed deployment with the last line of its replica's error (Serve's message ends
    with the constructor's traceback). ``deploy_watch`` prints the same line on Kubernetes."""
    failed = [(name, d.message) for name, d in (app.deployments.items() if app else ()) if d.status != "HEALTHY"]
    reasons = [f"{name} failed to start {START_ATTEMPTS} times: {_last_line(message)}" for name, message in failed]
    return "the app failed to deploy: " + ("; ".join(reasons) or (app.message if app else "no status"))


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


def _stop(app_name: str, signals: ServeSignals, drain_s: float) -> None:
    t0 = time.monotonic()
    if signals.signum == signal.SIGTERM:
        signals.extend(drain_s)
        print(f"draining: new requests get 503; in-flight ones have {drain_s:g} s", flush=True)
        left = drain(app_name, drain_s, signals.hurry)
        print(f"drained in {time.monotonic() - t0:.2f} s, {left} request(s) left", flush=True)
    print("shutting down", flush=True)
    end_streams(app_name)
    print(f"streams ended in {time.monotonic() - t0:.2f} s", flush=True)


def drain(app_name: str, drain_s: float, hurry: threading.Event) -> int:
    """The ingress refuses new requests (503) while those in flight go on, until none is left,
    ``drain_s`` has passed or ``hurry`` is set; returns how many were left."""
    from ray import serve

    ingress = serve.get_deployment_handle("OpenAIIngress", app_name=app_name)
    deadline = time.monotonic() + drain_s
    try:
        left = ingress.drain.remote().result(timeout_s=_CALL_TIMEOUT_S)
        while left and time.monotonic() < deadline and not hurry.wait(_DRAIN_POLL_S):
            left = ingress.num_in_flight.remote().result(timeout_s=_CALL_TIMEOUT_S)
    except Exception as e:  # the ingress is gone: nothing is left to drain through it
        print(f"could not drain: {type(e).__name__}: {e}", flush=True)
        return 0
    return left


def end_streams(app_name: str, timeout_s: float = 2.0) -> None:
    """Every engine replica ends its requests with a ``shutting_down`` error; waits (at most
    ``timeout_s``) until the ingress has no stream left to write, so clients read the error."""
    from ray import serve

    try:
        planner = serve.get_deployment_handle("ClusterPlanner", app_name=app_name)
        engine = serve.get_deployment_handle("EngineServer", app_name=app_name)
        replica_ids = planner.engine_actor_names.remote().result(timeout_s=timeout_s)
        for replica_id in replica_ids:
            engine.end_streams.remote(route_to=replica_id).result(timeout_s=timeout_s)
    except Exception as e:  # a replica gone already: its streams have ended with it
        print(f"could not end every stream before stopping: {type(e).__name__}: {e}", flush=True)
    # The error events still go through the ingress to the clients: leave them a moment.
    time.sleep(_ERROR_EVENT_GRACE_S)
