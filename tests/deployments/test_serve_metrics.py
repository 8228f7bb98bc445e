"""/metrics of the SmolLM2 app, read directly and scraped by a real Prometheus server."""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import API_KEY, APP, LONG_PROMPT, complete, requests_while_scraped, wait_engine_idle, wait_for_series

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

SERIES = {
    "spin_requests_running": "gauge", "spin_requests_waiting": "gauge",
    "spin_time_to_first_token_seconds": "histogram", "spin_inter_token_latency_seconds": "histogram",
    "spin_e2e_request_latency_seconds": "histogram",
    "spin_prompt_tokens": "counter", "spin_generation_tokens": "counter", "spin_request_success": "counter",
    "spin_buffer_lookups": "counter", "spin_buffer_hits": "counter", "spin_retrieved_bytes": "counter",
    "spin_evicted_pages": "counter", "spin_prefix_cache_queries": "counter", "spin_prefix_cache_hits": "counter",
    "spin_promoted_pages": "counter", "spin_spilled_pages": "counter", "spin_num_preemptions": "counter",
    "spin_kv_pages": "gauge", "spin_kv_bytes": "gauge", "spin_kv_allocated_bytes": "gauge",
    "spin_metadata_bytes": "gauge",
    "spin_attention_rank_seconds": "counter", "spin_attention_bubble_seconds": "counter",
    "spin_head_placement_imbalance": "gauge", "spin_engine_requests": "counter",
}
QUERIES = {
    "buffer hit ratio": "sum(rate(spin_buffer_hits_total[1m])) / sum(rate(spin_buffer_lookups_total[1m]))",
    "TTFT p99": "histogram_quantile(0.99, sum by (le) (rate(spin_time_to_first_token_seconds_bucket[1m])))",
    "bubble ratio": "sum(rate(spin_attention_bubble_seconds_total[1m])) "
                    "/ clamp_min(sum(rate(spin_attention_rank_seconds_total[1m])), 1e-9)",
}


def _families(base: str) -> dict:
    r = httpx.get(f"{base}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_every_series_is_exported_with_model_name(spin_app):
    base, _ = spin_app
    complete(base, LONG_PROMPT)
    # Engine counters reach /metrics through the planner's next stats report (every 0.5 s).
    deadline = time.monotonic() + 30
    while True:
        fams = _families(base)
        hits = [s.value for s in fams["spin_buffer_hits"].samples if s.name == "spin_buffer_hits_total"]
        if (hits and hits[0] > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for name, kind in SERIES.items():
        assert name in fams and fams[name].type == kind, name
        assert fams[name].samples, name
        assert all(s.labels.get("model_name") == "smollm2" for s in fams[name].samples), name
    value = {s.name: s.value for f in fams.values() for s in f.samples if len(s.labels) == 1}
    assert value["spin_buffer_lookups_total"] >= value["spin_buffer_hits_total"] > 0  # Quest over the buffer
    assert value["spin_prompt_tokens_total"] > 0 and value["spin_generation_tokens_total"] > 0
    tiers = {(s.labels["tier"], s.labels["state"]) for s in fams["spin_kv_pages"].samples}
    assert tiers == {(t, s) for t in ("gpu", "host", "gpu_buffer") for s in ("free", "used")}


def test_engine_gauges_follow_a_state_change_within_a_second(spin_app):
    """The engine's report is refreshed before it idles and sent every 0.5 s: /metrics shows a
    request start running, and its pages freed once its client has gone, within about 1 s."""
    base, _ = spin_app
    wait_engine_idle(APP)
    body = {"model": "smollm2", "prompt": LONG_PROMPT, "max_tokens": 400, "min_tokens": 400, "stream": True}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Held until the block ends: a dropped line iterator may close the stream (through
            # a collected reference cycle, at a random time), and the server sees a client gone.
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            running_s = _seconds_until(base, lambda running, used: running == 1 and used > 0)
        # the connection closes here: the client is gone
    freed_s = _seconds_until(base, lambda running, used: running == 0 and used == 0)
    print(f"running on /metrics after {running_s:.2f} s, freed after {freed_s:.2f} s")
    assert running_s <= 1.5 and freed_s <= 1.5


def _seconds_until(base: str, state, timeout_s: float = 10.0) -> float:
    """Seconds until /metrics shows ``state(running requests, used KV pages)``."""
    started = time.monotonic()
    seen = []  # (seconds, running, used) each time /metrics changed
    while time.monotonic() - started < timeout_s:
        fams = _families(base)
        running = fams["spin_requests_running"].samples[0].value
        used = sum(s.value for s in fams["spin_kv_pages"].samples if s.labels["state"] == "used")
        if state(running, used):
            return time.monotonic() - started
        if not seen or seen[-1][1:] != (running, used):
            seen.append((round(time.monotonic() - started, 2), running, used))
        time.sleep(0.05)
    raise TimeoutError(f"/metrics did not reach the state within {timeout_s}s; (s, running, used pages) seen: {seen}")


def test_prometheus_scrapes_and_answers_the_dashboard_queries(spin_app, prometheus):
    base, _ = spin_app
    requests_while_scraped(base, prometheus, num_requests=3, max_tokens=6)
    hit_ratio = wait_for_series(prometheus, QUERIES["buffer hit ratio"])
    assert 0 < float(hit_ratio[0]["value"][1]) <= 1
    ttft = wait_for_series(prometheus, QUERIES["TTFT p99"])
    assert float(ttft[0]["value"][1]) > 0
    bubble = wait_for_series(prometheus, QUERIES["bubble ratio"])
    assert float(bubble[0]["value"][1]) == 0  # one rank until heads are placed
