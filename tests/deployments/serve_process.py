"""A real `spin-cluster serve` process for the tests that signal or starve it: its own Ray
temp folder, and an environment tag that every process it starts inherits, so that a test
can name each one left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil

SERVE = os.path.join(os.path.dirname(sys.executable), "spin-cluster")
_TAG = "SPIN_TEST_SERVE_TAG"


class ServeProcess:
    def __init__(self, *args: str, log_dir: Path) -> None:
        self.tag = uuid.uuid4().hex
        # Short: Ray's socket paths under it must stay within the 107 bytes of a Unix socket.
        self.ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": self.ray_tmp, _TAG: self.tag}
        env.pop("SPIN_API_KEY", None)
        self.out_path, self.err_path = log_dir / "serve.out", log_dir / "serve.err"
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen([SERVE, "serve", *args], env=env, stdout=self.out_path.open("w"),
                                     stderr=self.err_path.open("w"))

    def stop(self, sig: int, timeout_s: float = 60.0) -> float:
        """Sends ``sig``; seconds until the process exited."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout_s)
        return time.monotonic() - t0

    def wait_for_process(self, name_part: str, timeout_s: float) -> None:
        """Until a process it started has ``name_part`` in its command line."""
        deadline = time.monotonic() + timeout_s
        while not any(name_part in " ".join(_cmdline(p)) for p in self.processes()):
            assert self.proc.poll() is None, self.said()
            assert time.monotonic() < deadline, f"no {name_part!r} within {timeout_s} s: {self.said()}"
            time.sleep(0.1)

    def processes(self) -> list[psutil.Process]:
        """Every live process carrying this run's tag (the command and all it started)."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(_TAG) == self.tag and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def left_behind(self, grace_s: float = 1.0) -> list[str]:
        """Command lines of the run's processes still alive ``grace_s`` after its exit."""
        deadline = time.monotonic() + grace_s
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [" ".join(_cmdline(p)) for p in left]

    def said(self) -> str:
        return f"stdout:\n{self.out_path.read_text()[-3000:]}\nstderr:\n{self.err_path.read_text()[-3000:]}"

    def close(self) -> None:
        for p in self.processes():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def read_stream(url: str, model: str, events: list, max_tokens: int = 4000) -> None:
    """Reads one completion stream to its end; appends its data events (parsed, or
    "[DONE]"), or the HTTP error that ended it."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as e:
        events.append(e)


def start_streams(base: str, model: str, num_streams: int, max_tokens: int = 4000,
                  timeout_s: float = 60.0) -> tuple[list[list], list[threading.Thread]]:
    """``num_streams`` completion streams on ``base``, each read by a thread of its own, once
    every one has its first token: (their event lists, their threads)."""
    streams = [[] for _ in range(num_streams)]
    threads = [threading.Thread(target=read_stream, args=(f"{base}/v1/completions", model, events, max_tokens))
               for events in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while not all(any(isinstance(e, dict) and e.get("choices") for e in events) for events in streams):
        assert time.monotonic() < deadline, f"the streams did not all start: {[e[-1:] for e in streams]}"
        time.sleep(0.1)
    return streams, threads


def broken_model(smollm2_path: str, out: Path) -> Path:
    """SmolLM2's config and tokenizer beside weights that are not a safetensors file: the
    checks before Ray starts pass (they read config.json), the engine replica cannot load."""
    out.mkdir()
    for name in os.listdir(smollm2_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(smollm2_path, name), out / name)
    (out / "model.safetensors").write_bytes(b"\xff" * 1000)
    return out
