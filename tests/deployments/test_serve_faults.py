"""Limits and faults, on a second app (a toy model, one running request, one waiting):
a full queue gives 429, and a killed engine replica ends its stream with an error event,
turns /health to 503 within 1.5 s, is restarted by Serve, and the next request succeeds."""

import contextlib
import json
import time

import httpx
import pytest
import ray
from ray import serve

from .conftest import API_KEY, SMALL_APP, engine_handle, wait_engine_idle

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

MODEL = "toy"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL, "prompt": "Hello there", "max_tokens": 480, "min_tokens": 480, "stream": True}


@pytest.fixture(scope="module")
def small_app(serve_port, tiny_llama_path):
    from spin_cluster.deployments.app import build_app

    args = {
        "config": "default",
        "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 512},
        "cache": {"kv_cache_gib": 0.01},
        "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 512},
        # Silence alone takes 30 s to count as death: a dead engine must be seen by the
        # planner's probe, well within that.
        "serve": {"model_name": MODEL, "max_waiting_requests": 1, "handle_timeout_s": 30, "token_timeout_s": 30,
                  "stats_interval_s": 0.25, "engine_stale_s": 30.0,
                  "engine_torch_threads": 2},  # more than the one CPU the replica reserves
    }
    serve.run(build_app(args), name=SMALL_APP, route_prefix=f"/{SMALL_APP}")
    base = f"http://127.0.0.1:{serve_port}/{SMALL_APP}"
    yield base
    serve.delete(SMALL_APP)


def _first_data_line(lines) -> str:
    """Reads up to the first event from ``lines``, an iterator the caller keeps: closing a
    line iterator early closes the connection, which the server takes for a disconnect."""
    for line in lines:
        if line.startswith("data: {"):
            return line
    raise AssertionError("the stream ended before any data")


def test_a_full_queue_is_429_with_an_error_body(small_app):
    with httpx.Client(base_url=small_app, headers=AUTH, timeout=60) as running, \
            httpx.Client(base_url=small_app, headers=AUTH, timeout=60) as waiting:
        with running.stream("POST", "/v1/completions", json=LONG) as first:
            assert first.status_code == 200
            first_lines = first.iter_lines()
            _first_data_line(first_lines)  # running: the engine takes one request at a time
            with waiting.stream("POST", "/v1/completions", json=LONG) as second:
                assert second.status_code == 200  # admitted, waiting in the engine's queue
                r = httpx.post(f"{small_app}/v1/completions", headers=AUTH, timeout=60,
                               json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "queue_full"
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    info = wait_engine_idle(SMALL_APP)
    assert info["num_free_pages"] == info["num_total_pages"]


def test_a_killed_engine_ends_the_stream_with_an_error_and_comes_back(small_app):
    handle = engine_handle(SMALL_APP)
    old = handle.replica_info.remote().result(timeout_s=30)
    assert old["torch_threads"] == 2  # serve.engine_torch_threads (Ray's own setting gives 1)
    assert old["step_threads"] == "None"  # a count fixed for every step
    with httpx.Client(base_url=small_app, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            _first_data_line(lines)
            ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
            rest = [line for line in lines if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == "engine_unavailable", rest[-3:]
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
    assert rest[-1] == "data: [DONE]"

    assert _health_turns(small_app, 503)  # no engine until Serve has started a new one
    new = _wait_for_new_engine(old["replica_id"])
    assert httpx.get(f"{small_app}/health", timeout=30).status_code == 200
    r = httpx.post(f"{small_app}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "min_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert new != old["replica_id"]


def test_health_is_503_within_1_5_s_of_an_engine_death_and_200_once_it_is_back(small_app):
    assert httpx.get(f"{small_app}/health", timeout=30).status_code == 200
    old = engine_handle(SMALL_APP).replica_info.remote().result(timeout_s=30)
    ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
    killed_s = time.monotonic()
    assert _health_turns(small_app, 503, timeout_s=1.5), "still 200 1.5 s after the engine died"
    print(f"/health 503 {time.monotonic() - killed_s:.2f} s after the kill")
    _wait_for_new_engine(old["replica_id"])
    assert _health_turns(small_app, 200, timeout_s=10)


def _health_turns(base: str, status: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/health", timeout=30)
        if r.status_code == status:
            return True
        time.sleep(0.05)
    return False


def _wait_for_new_engine(old_id: str, timeout_s: float = 120.0) -> str:
    """Serve replaces the replica; wait until the planner routes to the new one only."""
    planner = serve.get_deployment_handle("ClusterPlanner", app_name=SMALL_APP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            live = {r.replica_id for r in planner.live_reports.remote().result(timeout_s=10)}
            if live and old_id not in live:
                return live.pop()
        time.sleep(0.5)
    raise TimeoutError(f"no new engine replica within {timeout_s}s")
