"""`spin-cluster serve` and Ctrl-C: with 8 streams in flight it exits within 5 s, each stream
ends with an error event, and none of the processes it started is left."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import free_port, wait_healthy
from .serve_process import start_streams

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

NUM_STREAMS = 8
STOP_WITHIN_S = 5.0


def test_ctrl_c_stops_the_server_within_5_s_ending_the_streams(smollm2_path, tmp_path):
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("SPIN_API_KEY", None)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "spin-cluster"), "serve", "--model", smollm2_path,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout_s=180)
        streams, threads = start_streams(base, Path(smollm2_path).name, NUM_STREAMS)
        started = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        took_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = (tmp_path / "serve.log").read_text()
    print(f"stopped in {took_s:.2f}s:", *[line for line in said.splitlines() if " in " in line and line.endswith(" s")])
    assert took_s < STOP_WITHIN_S, said[-3000:]
    for events in streams:
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors, events[-3:]
        assert errors[0]["error"]["code"] == "shutting_down"
    time.sleep(0.5)
    left = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, [psutil.Process(p).cmdline() for p in left]
