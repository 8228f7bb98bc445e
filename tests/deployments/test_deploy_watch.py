"""The deploy state a Kubernetes pod's log shows (``deploy_watch``): one line a change, and a
failed deploy in the words `spin-cluster serve` uses."""

import subprocess
import sys
from types import SimpleNamespace

from spin_cluster.deployments.deploy_watch import lines, status_line
from spin_cluster.deployments.local import START_ATTEMPTS, failure_message


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

