"""`spin-cluster serve` told to stop while it starts, while a deploy fails, and while it serves:
gone within 5 s with no process of it left; a replica that cannot start ends it with its
reason; SIGTERM while serving drains (503 to new requests, in-flight ones finish within
serve.drain_s, or end with an error event after it)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from spin_cluster.deployments.signals import STOP_WITHIN_S

from .conftest import free_port, wait_healthy
from .serve_process import ServeProcess, broken_model, start_streams

pytestmark = [pytest.mark.serve, pytest.mark.timeout(180)]

NUM_STREAMS = 8
FAIL_WITHIN_S = 60.0


@pytest.fixture
def serve(tmp_path):
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        started.append(ServeProcess(*args, "--port", str(free_port()), log_dir=tmp_path))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_sigterm_3_s_into_a_start(serve, smollm2_path):
    s = serve("--model", smollm2_path)
    time.sleep(3.0)
    took_s = s.stop(signal.SIGTERM)
    assert took_s < STOP_WITHIN_S, s.said()
    # The default handler before local mode installs its own (the checks), 128 + 15 after it.
    assert s.proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), s.said()
    assert s.left_behind() == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_ray_starts(serve, smollm2_path, sig):
    s = serve("--model", smollm2_path)
    s.wait_for_process("gcs_server", timeout_s=60)
    took_s = s.stop(sig)
    assert took_s < STOP_WITHIN_S, s.said()
    assert s.proc.returncode == 128 + sig, s.said()
    assert s.left_behind() == []


def test_a_replica_that_cannot_start_ends_serve_with_its_reason(serve, smollm2_path, tmp_path):
    s = serve("--model", str(broken_model(smollm2_path, tmp_path / "broken")))
    s.proc.wait(timeout=FAIL_WITHIN_S + 30)
    took_s = time.monotonic() - s.started_s
    errors = [line for line in s.err_path.read_text().splitlines() if line.startswith("error: ")]
    assert errors == ["error: the app failed to deploy: EngineServer failed to start 2 times: "
                      "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: "
                      "header too large"], s.said()
    assert s.proc.returncode == 1
    assert took_s < FAIL_WITHIN_S, f"took {took_s:.1f} s"
    assert s.left_behind() == []


def test_sigterm_during_a_failing_deploy(serve, smollm2_path, tmp_path):
    s = serve("--model", str(broken_model(smollm2_path, tmp_path / "broken")))
    s.wait_for_process("ServeReplica:spin:EngineServer", timeout_s=FAIL_WITHIN_S)
    took_s = s.stop(signal.SIGTERM)
    assert took_s < STOP_WITHIN_S, s.said()
    assert s.proc.returncode == 128 + signal.SIGTERM, s.said()
    assert s.left_behind() == []


def test_a_stop_that_hangs_is_ended_by_the_watchdog():
    """The backstop: a stop whose steps never return (here: none is taken) still ends the
    process within 5 s of the signal."""
    code = ("import os, signal, time\n"
            "from spin_cluster.deployments.signals import ServeSignals\n"
            "s = ServeSignals(); s.install(); s.serving()\n"
            "print(time.monotonic(), flush=True); os.kill(os.getpid(), signal.SIGTERM)\n"
            "s.stop.wait(); time.sleep(60)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took_s = time.monotonic() - float(done.stdout.split()[0])
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip().endswith("stop: the stop outlasted its deadline; exiting now")
    assert took_s < STOP_WITHIN_S


# ---- SIGTERM while serving: the drain ----------------------------------------------------

def _serve_streams(serve, smollm2_path: str, tmp_path: Path, drain_s: float, max_tokens: int):
    """A server with ``drain_s``, and NUM_STREAMS streams of ``max_tokens`` tokens running on
    it: (the server, its base url, the streams' event lists, their threads)."""
    config = tmp_path / "drain.yaml"
    config.write_text(f"serve: {{drain_s: {drain_s}}}\n")
    s = serve("--config", str(config), "--model", smollm2_path)
    port = s.proc.args[s.proc.args.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, timeout_s=120)
    streams, threads = start_streams(base, Path(smollm2_path).name, NUM_STREAMS, max_tokens)
    return s, base, streams, threads


def test_sigterm_drains_8_streams_to_their_end(serve, smollm2_path, tmp_path):
    s, base, streams, threads = _serve_streams(serve, smollm2_path, tmp_path, drain_s=40, max_tokens=48)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    while (health := httpx.get(f"{base}/health", timeout=10)).status_code != 503:  # the drain has begun
        assert time.monotonic() - t0 < STOP_WITHIN_S, health.text
        time.sleep(0.1)
    late = httpx.post(f"{base}/v1/completions", json={"model": Path(smollm2_path).name, "prompt": "Hi"}, timeout=10)
    for t in threads:
        t.join(timeout=60)
    streams_end_s = time.monotonic() - t0
    s.proc.wait(timeout=60)
    exit_s = time.monotonic() - t0
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    assert health.json()["status"] == "draining"
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        finish = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
        assert finish[-1] == "length" and not [e for e in events if isinstance(e, dict) and "error" in e]
    assert s.proc.returncode == 0, s.said()
    assert exit_s - streams_end_s < STOP_WITHIN_S, f"streams ended after {streams_end_s:.1f} s, exit {exit_s:.1f} s"
    assert s.left_behind() == []


def test_sigterm_ends_what_the_grace_period_leaves_with_an_error_event(serve, smollm2_path, tmp_path):
    drain_s = 2.0
    s, base, streams, threads = _serve_streams(serve, smollm2_path, tmp_path, drain_s=drain_s, max_tokens=4000)
    took_s = s.stop(signal.SIGTERM)
    for t in threads:
        t.join(timeout=10)
    assert drain_s <= took_s < drain_s + STOP_WITHIN_S, s.said()
    for events in streams:
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["error"]["code"] == "shutting_down", events[-3:]
    assert s.proc.returncode == 0, s.said()
    assert s.left_behind() == []
