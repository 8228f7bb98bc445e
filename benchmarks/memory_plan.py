"""The memory plan of `spin-cluster serve` against what its processes hold (not a test).

    python benchmarks/memory_plan.py [--configs default spin] [--model DIR] [--out JSON]

For each app config: the plan that the checks before Ray starts make (``preflight.memory_plan``:
the host tier, the CPU page pool, the weights, the processes), then a real ``spin-cluster
serve`` on 127.0.0.1 with one completion, and the unique memory (USS, psutil) of the command
and every process it started, summed. The plan should be a little above the sum: it is what
the check holds the machine's room to.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from spin_cluster.bench.args import add_model, add_out, model_path, save

GIB = 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uss_bytes(proc: subprocess.Popen) -> int:
    """USS of the command and every process it started (Ray's services, its workers)."""
    root = psutil.Process(proc.pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _served_uss(config: str, model: str, ready_timeout_s: float) -> int:
    port = _free_port()
    cli = Path(sys.executable).with_name("spin-cluster")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("SPIN_API_KEY", None)
    proc = subprocess.Popen([str(cli), "serve", "--config", config, "--model", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{config}: the server did not become ready (exit {proc.poll()})")
            time.sleep(1)
        body = {"model": Path(model).name, "prompt": "Once upon a time", "max_tokens": 16}
        httpx.post(f"{base}/v1/completions", json=body, timeout=60).raise_for_status()
        return _uss_bytes(proc)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def measure(config: str, model: str, ready_timeout_s: float) -> dict:
    from spin_cluster.deployments.preflight import memory_plan
    from spin_cluster.deployments.settings import load_app_config
    from spin_cluster.models.config import ModelConfig

    plan = memory_plan(load_app_config({"config": config, "model": {"path": model}}), ModelConfig.from_folder(model))
    uss = _served_uss(config, model, ready_timeout_s)
    return {"config": config, "plan": plan.describe(), "plan_bytes": plan.total_bytes, "host_tier_bytes": plan.host_tier_bytes,
            "measured_uss_bytes": uss, "plan_over_measured": plan.total_bytes / uss}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["default", "spin"], help="app configs (files or bundled names)")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    add_model(ap)
    add_out(ap)
    args = ap.parse_args(argv)
    model = model_path(args)
    rows = []
    for config in args.configs:
        rows.append(measure(config, model, args.ready_timeout_s))
        print(json.dumps(rows[-1]), flush=True)
    save(args, rows)
    return rows


if __name__ == "__main__":
    main()
