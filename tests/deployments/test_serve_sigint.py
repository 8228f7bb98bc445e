"""`spin-cluster serve` and Ctrl-C: with 8 streams in flight it exits within 5 s, each stream
ends with an error event, and none of the processes it started is left."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from .conftest import free_port, wait_healthy

pytestmark = [pytest.mark.serve, pytest.mark.timeout(300)]

NUM_STREAMS = 8
STOP_WITHIN_S = 5.0


def _stream(url: str, model: str, events: list) -> None:
    """Reads one stream to its end; appends its data events (parsed, or "[DONE]")."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as e:
        events.append(e)


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
        streams = [[] for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=_stream, args=(f"{base}/v1/completions", Path(smollm2_path).name, s)) for s in streams]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(any(isinstance(e, dict) and e.get("choices") for e in s) for s in streams):
            assert time.monotonic() < deadline, f"the streams did not all start: {[s[-1:] for s in streams]}"
            time.sleep(0.1)
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
