"""A real Ray Serve cluster for the deployments tests, its HTTP API on 127.0.0.1.

One Ray instance for this test package (started by the first test that needs it, shut
down after the package's last test); the apps on it are deployed once each. Ray's usage
reporting is off, and all test traffic goes to 127.0.0.1. (Ray's own servers bind where Ray
puts them; `spin-cluster serve` keeps them on loopback, which test_local_listeners.py checks.)
"""

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

API_KEY = "test-key-123"
APP = "spin"  # the SmolLM2 app: Spin's offloaded cache with Quest selection
SMALL_APP = "small"  # a toy model with tiny limits: queue-full and fault tests


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spin_app_config(model_path: str) -> dict:
    """SmolLM2 on Spin's offloaded cache with Quest: small enough tiers for a test machine,
    a budget small enough that selection really selects (prompts past 112 tokens), every
    page's home on the host so that the buffer (and its metrics) work on every step."""
    return {
        "config": "spin-quest",
        "model": {"path": model_path, "device": "cpu", "dtype": "float32", "max_model_len": 1024},
        "cache": {"kind": "offloaded", "page_size": 16, "host_kv_gib": 1.0, "kv_cache_gib": 0.5, "gpu_home_fraction": 0.0},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024},
        "sparse": {"algorithm": "quest", "budget": 64, "sink_tokens": 16, "local_tokens": 32},
        "serve": {"model_name": "smollm2", "max_waiting_requests": 64, "engine_num_cpus": 1.0,
                  "handle_timeout_s": 60, "token_timeout_s": 60},
    }


@pytest.fixture(scope="package")
def serve_port():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_worker_niceness", "0")  # as `spin-cluster serve` and the chart run them
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    old_key = os.environ.get("SPIN_API_KEY")
    os.environ["SPIN_API_KEY"] = API_KEY  # replicas inherit the environment of ray.init
    import ray
    from ray import serve

    # address="local": always a cluster of its own, never one whose address a killed run left behind
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        if old_key is None:
            os.environ.pop("SPIN_API_KEY", None)
        else:
            os.environ["SPIN_API_KEY"] = old_key


@pytest.fixture(scope="package")
def spin_app(serve_port, smollm2_path):
    """The SmolLM2 app at /; yields (base url, app config args)."""
    from ray import serve

    from spin_cluster.deployments.app import build_app

    args = spin_app_config(smollm2_path)
    serve.run(build_app(args), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{serve_port}"
    wait_healthy(base)
    yield base, args
    serve.delete(APP)


# Past the Quest budget of spin_app_config, so that selection (and the buffer) really works.
LONG_PROMPT = "The river runs through the old town, past the mill and the church. " * 12 + "Then"


def complete(base: str, prompt: str, max_tokens: int = 8) -> None:
    """One completion on the SmolLM2 app, which must succeed."""
    import httpx

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens}
    r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200, r.text


def wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not turn 200 within {timeout_s}s")


def engine_handle(app_name: str):
    from ray import serve

    return serve.get_deployment_handle("EngineServer", app_name=app_name)


def wait_engine_idle(app_name: str, timeout_s: float = 60.0) -> dict:
    """Polls the engine's integrity check until nothing runs or waits; returns its last
    answer (the check itself raises if a page is leaked or owned twice)."""
    handle = engine_handle(app_name)
    deadline = time.monotonic() + timeout_s
    while True:
        info = handle.check_integrity.remote().result(timeout_s=30)
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine is still busy after {timeout_s}s: {info}")
        time.sleep(0.25)


class RayLogs:
    """What the Ray session's log files (every worker's and Serve's) gain from now on."""

    def __init__(self) -> None:
        import ray

        self._dir = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        self._sizes = {path: path.stat().st_size for path in self._files()}

    def new_text(self, under: str = "") -> str:
        """``under``: a subfolder of the log folder (``serve``: the replicas' own log files)."""
        parts = []
        for path in self._files(under):
            with path.open("rb") as f:
                f.seek(self._sizes.get(path, 0))
                parts.append(f.read().decode(errors="replace"))
        return "".join(parts)

    def _files(self, under: str = "") -> list[Path]:
        folder = self._dir / under
        return [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".log", ".err", ".out")]


@pytest.fixture
def prometheus(spin_app, tmp_path):
    """Debian's Prometheus server scraping the SmolLM2 app's /metrics every second; yields its URL."""
    binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if binary is None:
        pytest.skip("no prometheus binary (make test installs Debian's prometheus when run as root)")
    target = spin_app[0].removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: spin, metrics_path: /metrics, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def requests_while_scraped(base: str, prom: str, num_requests: int, max_tokens: int) -> None:
    """Long-prompt completions on the SmolLM2 app, between scrapes: the first scrape comes
    before them (rates need two samples); after them, a few more scrapes and the engine's next
    stats report."""
    wait_for_series(prom, 'up{job="spin"} == 1')
    for i in range(num_requests):
        complete(base, f"{LONG_PROMPT} {i}", max_tokens=max_tokens)
    time.sleep(3)


def prometheus_query(prom: str, promql: str) -> list:
    """The instant query's result vector (raises on a malformed query)."""
    import httpx

    r = httpx.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def wait_for_series(prom: str, promql: str, timeout_s: float = 60.0) -> list:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            result = prometheus_query(prom, promql)
            if result:
                return result
        time.sleep(0.5)
    raise TimeoutError(f"no series for {promql!r} within {timeout_s}s")
