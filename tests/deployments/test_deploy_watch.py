"""The deploy state a Kubernetes pod's log shows (``deploy_watch``): one line a change, and a
failed deploy in the words `spin-cluster serve` uses."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from spin_cluster.deployments.deploy_watch import AppState, lines, status_line
from spin_cluster.deployments.local import START_ATTEMPTS, failure_message

from .conftest import free_port


def _app(status, deployments=None, message=""):
    deps = {name: SimpleNamespace(status=s, message=m) for name, (s, m) in (deployments or {}).items()}
    return SimpleNamespace(status=status, message=message, deployments=deps)


FAILED = _app("DEPLOY_FAILED", {
    "OpenAIIngress": ("HEALTHY", ""),
    "EngineServer": ("DEPLOY_FAILED", "The deployment failed to start 3 times in a row.\nTraceback (most recent call "
                                      "last):\n  ...\nValueError: the GPU buffer (0 page slots) cannot hold one "
                                      "request's selected pages\n"),
})


def test_a_failed_deploy_reads_as_the_local_command_prints_it():
    line = status_line("spin", FAILED)
    assert line == f"error: {failure_message(FAILED)}"
    assert line == ("error: the app failed to deploy: EngineServer failed to start "
                    f"{START_ATTEMPTS} times: ValueError: the GPU buffer (0 page slots) cannot hold one request's "
                    "selected pages")


def test_one_line_a_change_of_state():
    states = iter([None, _app("DEPLOYING"), _app("DEPLOYING"), _app("RUNNING"), _app("RUNNING"), FAILED])
    waits = []
    seen = lines("spin", lambda: next(states), poll_s=2.5, sleep=waits.append)
    got = [next(seen) for _ in range(4)]
    assert got == ["app spin: not deployed", "app spin: DEPLOYING", "app spin: RUNNING", status_line("spin", FAILED)]
    assert waits == [2.5] * 5  # every read but the last was followed by a wait


def test_the_command_refuses_a_poll_interval_of_zero():
    r = subprocess.run([sys.executable, "-m", "spin_cluster.cli", "watch-deploy", "--poll-s", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--poll-s must be > 0" in r.stderr, r



def test_a_dashboard_not_answering_yet_is_one_waiting_line():
    from spin_cluster.deployments.deploy_watch import Unreachable

    def read():
        r = next(reads)
        if isinstance(r, Exception):
            raise r
        return r

    reads = iter([Unreachable("ConnectError: refused"), Unreachable("ConnectError: refused"),
                  Unreachable("HTTP 503: the GCS may be down"), _app("RUNNING")])
    seen = lines("spin", read, poll_s=1, sleep=lambda s: None, source="Ray's dashboard at D")
    assert [next(seen) for _ in range(3)] == ["waiting for Ray's dashboard at D: ConnectError: refused",
                                              "waiting for Ray's dashboard at D: HTTP 503: the GCS may be down",
                                              "app spin: RUNNING"]


def test_serves_status_json_reads_as_the_drivers_status():
    """Serve's ApplicationDetails, as the dashboard returns it, gives the same line as the
    driver's ApplicationStatusOverview (FAILED above)."""
    body = {"status": "DEPLOY_FAILED", "message": "", "route_prefix": "/", "deployments": {
        name: {"name": name, "status": d.status, "message": d.message, "replicas": []}
        for name, d in FAILED.deployments.items()}}
    assert status_line("spin", AppState.from_json(body)) == status_line("spin", FAILED)


# ---- against a real cluster: Ray's dashboard and Serve on 127.0.0.1 -------------------------

def _watch(app, dashboard):
    return subprocess.Popen([sys.executable, "-m", "spin_cluster.cli", "watch-deploy", "--app", app,
                             "--dashboard", dashboard, "--poll-s", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stop(proc, grace_s=20):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _lines_until(proc, done, timeout_s):
    """The watcher's lines until ``done(line)`` or ``timeout_s`` (read on a thread: a pipe has no timeout)."""
    got, q = [], queue.Queue()
    threading.Thread(target=lambda: [q.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        got.append(line)
        if done(line):
            break
    return got


BROKEN = "the GPU buffer (0 page slots) cannot hold one request's selected pages"


@pytest.mark.timeout(240)
def test_the_watcher_reads_a_real_clusters_deploy_state_through_its_dashboard(tmp_path):
    """Started before the head (as the chart's container may be), the watcher waits, then
    prints the failed app's reason in the local command's words, and the running app's RUNNING."""
    dash = f"http://127.0.0.1:{free_port()}"
    spin = _watch("spin", dash)
    cluster = subprocess.Popen([sys.executable, str(Path(__file__).with_name("watched_cluster.py")),
                                dash.rsplit(":", 1)[1], str(free_port()), BROKEN],
                               stdout=subprocess.PIPE, stderr=(tmp_path / "cluster.log").open("w"), text=True,
                               start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    fine = None
    try:
        got = _lines_until(spin, lambda line: line.startswith("error:"), timeout_s=150)
        assert got[0] == f"watching app spin through Ray's dashboard at {dash}", got
        assert got[1].startswith(f"waiting for Ray's dashboard at {dash}: "), got
        assert got[-1] == ("error: the app failed to deploy: EngineServer failed to start "
                           f"{START_ATTEMPTS} times: ValueError: {BROKEN}"), (got, (tmp_path / "cluster.log").read_text()[-3000:])
        assert len(got) == len(set(got)), got  # one line a change
        fine = _watch("fine", dash)
        got = _lines_until(fine, lambda line: line.endswith("RUNNING"), timeout_s=60)
        assert got[-1] == "app fine: RUNNING", got
    finally:
        for proc in (spin, fine, cluster):
            if proc is not None:
                _stop(proc)
