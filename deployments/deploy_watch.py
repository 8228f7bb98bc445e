"""The app's deploy state on a cluster that another process deployed to (KubeRay's RayService),
one line a change, so that a Kubernetes pod's log says what `spin-cluster serve` says:

    spin-cluster watch-deploy [--app spin] [--dashboard http://127.0.0.1:8265] [--poll-s 5]

On KubeRay the head pod's container runs `ray start --block`, and the app is deployed through
Ray's dashboard: a replica that cannot start leaves its reason in Serve's status and in log
files under /tmp/ray, never in `kubectl logs`. The Helm chart runs this command beside it, in a
container of its own (``deploy-status``), so that

    kubectl logs <head pod> -c deploy-status

prints ``app spin: DEPLOYING``, then ``app spin: RUNNING`` or the same ``error: the app failed
to deploy: EngineServer failed to start 2 times: <the constructor's last line>`` that the local
command prints before it exits 1 (``local.failure_message``). Ray's own answer is a log shipper
(Fluent Bit) reading those files; this is the one line a user needs, with no other image.

It reads Serve's status from the dashboard's REST API (``GET /api/serve/applications/``, what
KubeRay's operator and ``serve status`` read), not as a Ray driver: a driver must reach the
GCS at the address the head advertises and join the cluster's job table, where an HTTP read of
the head's own dashboard needs neither. Until the dashboard answers (the head starting) it
prints a waiting line; it never deploys or stops anything, and runs until it is stopped.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# Serve's status path on the dashboard (ray.dashboard.modules.serve.sdk's STATUS_PATH).
STATUS_PATH = "/api/serve/applications/"
# A read that takes longer than this is a dashboard not answering yet.
_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DeploymentState:
    status: str
    message: str = ""


@dataclass(frozen=True)
class AppState:
    """The parts of Serve's ApplicationDetails that the lines use (``local.failure_message``
    reads the same attributes of the driver's ApplicationStatusOverview)."""

    status: str
    message: str = ""
    deployments: dict[str, DeploymentState] = field(default_factory=dict)

    @classmethod
    def from_json(cls, app: dict) -> AppState:
        deps = {name: DeploymentState(d.get("status", ""), d.get("message", ""))
                for name, d in (app.get("deployments") or {}).items()}
        return cls(app.get("status", ""), app.get("message", ""), deps)


class Unreachable(Exception):
    """The dashboard did not answer, or answered without Serve's status."""


def status_line(app_name: str, app: AppState | None) -> str:
    """One line for the app's state (None: not deployed)."""
    from spin_cluster.deployments.local import failure_message

    if app is None:
        return f"app {app_name}: not deployed"
    if app.status == "DEPLOY_FAILED":
        return f"error: {failure_message(app)}"
    return f"app {app_name}: {app.status}"


def lines(app_name: str, read: Callable[[], AppState | None], poll_s: float,
          sleep: Callable[[float], None] = time.sleep, source: str = "the dashboard") -> Iterator[str]:
    """Each new state's line, read with ``read()`` (the app's state, or None; raises
    ``Unreachable``) every ``poll_s``."""
    last = None
    while True:
        try:
            line = status_line(app_name, read())
        except Unreachable as e:
            line = f"waiting for {source}: {e}"
        if line != last:
            yield line
            last = line
        sleep(poll_s)


def reader(dashboard: str, app_name: str) -> Callable[[], AppState | None]:
    """``read()`` for ``lines``: one GET of Serve's status from the dashboard at ``dashboard``."""
    import httpx

    url = dashboard.rstrip("/") + STATUS_PATH
    # the head's own dashboard: no proxy
    client = httpx.Client(timeout=_READ_TIMEOUT_S, trust_env=False, headers=_auth_headers())

    def read() -> AppState | None:
        try:
            r = client.get(url)
        except httpx.HTTPError as e:
            raise Unreachable(f"{type(e).__name__}: {e}") from e
        if r.status_code != 200:  # 503 while the controller or the GCS is starting
            raise Unreachable(f"HTTP {r.status_code}: {r.text.strip()[:200]}")
        try:
            apps = r.json().get("applications") or {}
        except ValueError as e:
            raise Unreachable(f"not Serve's status: {r.text.strip()[:200]}") from e
        app = apps.get(app_name)
        return None if app is None else AppState.from_json(app)

    return read


def _auth_headers() -> dict[str, str]:
    """Ray's token for its dashboard, where token authentication is on (a new local cluster
    turns it on by default since Ray 2.5x): read as the ``ray`` and ``serve`` commands read it
    (RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). Ray keeps this
    in a private module; a Ray without it has no token authentication."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    except ImportError:
        return {}
    # (its warning that a token turns authentication on is for a cluster's owner, not a reader)
    logging.getLogger(maybe_enable_token_auth_if_token_available.__module__).setLevel(logging.ERROR)
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    return dict(get_auth_headers_if_auth_enabled({}))


def watch(app_name: str, dashboard: str, poll_s: float) -> int:
    print(f"watching app {app_name} through Ray's dashboard at {dashboard}", flush=True)
    for line in lines(app_name, reader(dashboard, app_name), poll_s, source=f"Ray's dashboard at {dashboard}"):
        print(line, file=sys.stderr if line.startswith("error:") else sys.stdout, flush=True)
    return 0
