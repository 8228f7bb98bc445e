"""The app's deploy state on a cluster that another process deployed to (KubeRay's RayService),
one line a change, so that a Kubernetes pod's log says what `spin-cluster serve` says:

    spin-cluster watch-deploy [--app spin] [--address 127.0.0.1:6379] [--poll-s 5]

On KubeRay the head pod's container runs `ray start --block`, and the app is deployed through
Ray's dashboard: a replica that cannot start leaves its reason in Serve's status and in log
files under /tmp/ray, never in `kubectl logs`. The Helm chart runs this command beside it, in a
container of its own (``deploy-status``), so that

    kubectl logs <head pod> -c deploy-status

prints ``app spin: DEPLOYING``, then ``app spin: RUNNING`` or the same ``error: the app failed
to deploy: EngineServer failed to start 3 times: <the constructor's last line>`` that the local
command prints before it exits 1 (``local.deploy_failure``). Ray's own answer is a log shipper
(Fluent Bit) reading those files; this is the one line a user needs, with no other image.

It connects as a Ray driver (Serve's status is read through the controller) and retries until
the cluster answers; it never deploys or stops anything, and runs until it is stopped.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

# How long to wait before trying again when the cluster does not answer (its head starting).
_CONNECT_RETRY_S = 5.0


def status_line(app_name: str, app: Any) -> str:
    """One line for the app's state: Serve's ApplicationStatusOverview or None (not deployed)."""
    from spin_cluster.deployments.local import failure_message

    if app is None:
        return f"app {app_name}: not deployed"
    if app.status == "DEPLOY_FAILED":
        return f"error: {failure_message(app)}"
    return f"app {app_name}: {app.status}"


def lines(app_name: str, read: Callable[[], Any], poll_s: float,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[str]:
    """Each new state's line, read with ``read()`` (the app's status, or None) every ``poll_s``."""
    last = None
    while True:
        line = status_line(app_name, read())
        if line != last:
            yield line
            last = line
        sleep(poll_s)


def _connect(address: str) -> None:
    import ray

    while True:
        try:
            ray.init(address=address, namespace="serve", log_to_driver=False, logging_level="ERROR")
            return
        except (ConnectionError, RuntimeError) as e:  # the head is still starting
            print(f"waiting for the Ray cluster at {address}: {e}", flush=True)
            time.sleep(_CONNECT_RETRY_S)


def watch(app_name: str, address: str, poll_s: float) -> int:
    from ray import serve

    _connect(address)
    print(f"watching app {app_name} on the Ray cluster at {address}", flush=True)
    for line in lines(app_name, lambda: serve.status().applications.get(app_name), poll_s):
        print(line, file=sys.stderr if line.startswith("error:") else sys.stdout, flush=True)
    return 0
