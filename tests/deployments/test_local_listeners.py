"""`spin-cluster serve` on its default host: every process it starts (Ray's GCS, raylet,
agents, workers, Serve's proxy and replicas) listens on loopback only, and all of them are
gone after Ctrl-C."""

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from .conftest import free_port, wait_healthy

# Starts its own Ray in a child process; the timeout stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(400)]


def test_serve_on_loopback_opens_no_other_address(tmp_path, tiny_llama_path):
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"kv_cache_gib": 0.01},
        "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 256},
        "serve": {"model_name": "toy"},
    }))
    # Names every process of this Ray in its command line; short, as Ray's socket paths under
    # it must fit 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="spin-", dir="/tmp"))
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("SPIN_API_KEY", None)
    serve = subprocess.Popen([sys.executable, "-m", "spin_cluster.cli", "serve", "--config", str(config),
                              "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                             stderr=(tmp_path / "serve.log").open("w"), start_new_session=True)
    started: dict[int, psutil.Process] = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=240)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "toy", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text  # the engine's workers are up too
        started = _processes_of(serve.pid, str(ray_tmp))
        listening = _listening(started.values())
        assert any(port == p for _, _, p in listening)  # the API itself, found this way
        assert any("gcs_server" in name for name, _, _ in listening) and len(listening) > 5, listening
        exposed = [entry for entry in listening if not _is_loopback(entry[1])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
        # Ray's workers start at nice 15 unless told otherwise: the engine would yield the CPU
        # to every other process, a load client included.
        engines = [p for p in started.values() if "EngineServer" in " ".join(_cmdline(p))]
        assert engines and all(p.nice() == 0 for p in engines), [(p.pid, p.nice()) for p in engines]
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(30)
    left = _wait_gone(started.values(), timeout_s=30)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert left == [], f"still running after Ctrl-C: {left}"


def _processes_of(root_pid: int, marker: str) -> dict[int, psutil.Process]:
    """The serve process, its descendants, and any process whose command line names this
    Ray's temp folder (Ray may hand some of its processes to init)."""
    root = psutil.Process(root_pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or ())):
            found.setdefault(p.pid, p)
    return found


def _cmdline(p: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return p.cmdline()
    return []


def _listening(processes) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``processes``."""
    out = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append((p.name(), conn.laddr.ip, conn.laddr.port))
    return out


def _is_loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also as IPv6 sockets show IPv4 (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _wait_gone(processes, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    alive = list(processes)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.5)
    left = []
    for p in alive:  # don't leave them behind for the next test
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(f"{p.pid} {p.name()}")  # (one that exits just now is gone, not left)
            p.kill()
    return left


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
