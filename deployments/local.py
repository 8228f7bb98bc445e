"""Local mode: start Ray on this machine, run the app, block until SIGINT/SIGTERM, shut down.

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
import threading
import time
from typing import Any

# Ray's logical CPUs in local mode: actors reserve fractions of these, not real cores, so
# a small machine still fits the ingress, the planner and an engine.
LOCAL_NUM_CPUS = 8
# Named for its use on Windows and macOS, where it is off by default; see run_local.
_RAY_KEEPS_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# How long the ingress gets to write the streams' error events before the cluster stops.
_ERROR_EVENT_GRACE_S = 0.5


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


def run_local(args: dict[str, Any], *, host: str = "127.0.0.1", port: int = 8000,
              app_name: str = "spin", stop: threading.Event | None = None) -> None:
    from spin_cluster.deployments.preflight import check_local_run
    from spin_cluster.deployments.settings import load_app_config

    # Bad settings, or settings the model or this machine cannot run, fail here: before Ray
    # (or even its import) starts, so the reason is the one line the user sees.
    config = load_app_config(args)
    num_cpus = max(LOCAL_NUM_CPUS, os.cpu_count() or 1)
    check_local_run(config, num_cpus)
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
    import ray
    from ray import serve

    from spin_cluster.deployments.app import build_app

    stop = stop or threading.Event()
    previous: dict[int, Any] = {}
    # A new single-machine cluster whose own services listen on node_ip (above).
    loopback = node_ip is not None and ipaddress.ip_address(node_ip).is_loopback
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _node_ip_address=node_ip,
             runtime_env={"worker_process_setup_hook": f"{__name__}.serve_grpc_on_loopback"} if loopback else None)
    try:
        serve.start(http_options={"host": host, "port": port})
        # Installed after Ray's start-up, which sets handlers of its own, and before the app's
        # deployment: /health can answer before serve.run returns, and a Ctrl-C then must
        # still end in the orderly shutdown below (it stops the loop once the app is up).
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        serve.run(build_app(config), name=app_name, route_prefix="/")
        print(f"serving {config.model_name} on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
        while not stop.wait(0.1):
            pass
        t0 = time.monotonic()
        print("shutting down", flush=True)
        end_streams(app_name)
        print(f"streams ended in {time.monotonic() - t0:.2f} s", flush=True)
    finally:
        # Not serve.shutdown(): it waits out each replica's graceful shutdown in turn (~25 s).
        # The streams have ended above; stopping the cluster this process started stops every
        # process of it, replicas included.
        t1 = time.monotonic()
        ray.shutdown()
        print(f"cluster stopped in {time.monotonic() - t1:.2f} s", flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
