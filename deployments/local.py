"""Local mode: start Ray on this machine, run the app, block until SIGINT/SIGTERM, shut down.

What ``spin-cluster serve`` runs. No dashboard; Ray's usage reporting is off, so nothing
leaves the machine.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# Ray's logical CPUs in local mode: actors reserve fractions of these, not real cores, so
# a small machine still fits the ingress, the planner and an engine.
LOCAL_NUM_CPUS = 8


def run_local(args: dict[str, Any], *, host: str = "127.0.0.1", port: int = 8000,
              app_name: str = "spin", stop: threading.Event | None = None) -> None:
    from spin_cluster.deployments.settings import load_app_config

    # Bad settings, or settings the model cannot run, fail here: before Ray (or even its
    # import) starts, so the reason is the one line the user sees.
    config = load_app_config(args)
    config.check_model()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from spin_cluster.deployments.app import build_app

    stop = stop or threading.Event()
    previous: dict[int, Any] = {}
    # A new single-machine cluster whose own services listen on loopback only.
    ray.init(address="local", num_cpus=max(LOCAL_NUM_CPUS, os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config), name=app_name, route_prefix="/")  # Ctrl-C here: KeyboardInterrupt
        # Installed after Ray's start-up, which sets handlers of its own.
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        print(f"serving {config.model_name} on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
        while not stop.wait(0.5):
            pass
        print("shutting down", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
