"""Two engine replicas on two nodes of a simulated Ray cluster: the planner routes to both,
and when one node is removed under 16 streams, its streams end with `engine_unavailable`,
the survivor's finish, nothing hangs, and new requests succeed. The cluster runs in a
process of its own (``two_node_cluster.py``): this package's other tests hold a Ray here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port

# Starts a three-node Ray; the timeout stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(480)]

SCRIPT = Path(__file__).with_name("two_node_cluster.py")


def test_two_engines_serve_and_a_removed_node_fails_only_its_streams(tiny_llama_path):
    # Loopback node addresses: every node's servers and all traffic stay on 127.0.0.1.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("SPIN_API_KEY", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), tiny_llama_path, str(free_port())], env=env,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-5000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    print(seen)
    assert seen["health_engines"] == 2
    assert seen["warm_up"] == [200] * 8
    counts = seen["requests_by_engine"]
    assert len(counts) == 2 and all(n > 0 for n in counts.values()), counts  # both engines served
    assert seen["streams_pending"] == 0  # no stream hangs
    ends = seen["stream_ends"]
    assert len(ends) == 16 and set(ends) <= {"finished", "engine_unavailable"}, ends
    assert "engine_unavailable" in ends and "finished" in ends, ends  # the removed node's, the survivor's
    assert seen["ended_after_s"]["engine_unavailable"] < 15  # Ray declares the node dead in ~1 s
    assert seen["after"] == [200] * 4  # new requests go to the survivor
    assert seen["health_after"]["engines"] == 1
