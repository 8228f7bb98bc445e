"""An engine replica running head-parallel ranks: ``serve.engine_ranks: 2`` on the CPU, rank 0
in the replica and rank 1 a Ray actor in the replica's placement group, on the toy model (2 KV heads: one per rank
in each layer). Answers equal the plain engine's; /metrics shows both ranks' attention time;
a dead follower fails the health check and Serve replaces the replica; deleting the app stops
the follower ranks."""

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from spin_cluster.deployments.settings import load_app_config
from spin_cluster.engine import Engine, SamplingParams

from .conftest import API_KEY, engine_handle, wait_healthy

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600),
              pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")]

HP_APP = "hp"
MODEL = "toy-hp"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hp_app(serve_port, tiny_llama_path):
    """Yields (base url, app args); deleted at the end unless a test already did."""
    from spin_cluster.deployments.app import build_app

    args = {
        "config": "default",
        "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 512},
        "cache": {"kv_cache_gib": 0.01},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 512},
        "serve": {"model_name": MODEL, "engine_ranks": 2, "handle_timeout_s": 60, "token_timeout_s": 60,
                  "stats_interval_s": 0.25},
    }
    serve.run(build_app(args), name=HP_APP, route_prefix=f"/{HP_APP}")
    base = f"http://127.0.0.1:{serve_port}/{HP_APP}"
    wait_healthy(base)
    state = {"deleted": False}
    yield base, args, state
    if not state["deleted"]:
        serve.delete(HP_APP)


@pytest.fixture(scope="module")
def client(hp_app):
    return openai.OpenAI(base_url=f"{hp_app[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_engine(hp_app):
    """The same config's plain (one-rank) engine, in this process."""
    return Engine(load_app_config(hp_app[1]).spin, progress=False)


def _replica_info() -> dict:
    return engine_handle(HP_APP).replica_info.remote().result(timeout_s=30)


def _live(pids: list[int]) -> list[int]:
    """Those of ``pids`` whose process is running (not gone, not a zombie)."""
    live = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            live.append(pid)
    return live


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _live(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _live(pids)


def _rank_metrics(base: str) -> tuple[dict[str, float], float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ranks = {s.labels["rank"]: s.value for s in fams["spin_attention_rank_seconds"].samples
             if s.name == "spin_attention_rank_seconds_total"}
    (bubble,) = [s.value for s in fams["spin_attention_bubble_seconds"].samples
                 if s.name == "spin_attention_bubble_seconds_total"]
    return ranks, bubble


def test_the_replica_runs_a_follower_rank(hp_app):
    info = _replica_info()
    assert len(info["follower_pids"]) == 1 and info["follower_pids"] != [info["pid"]]
    assert _live(info["follower_pids"]) == info["follower_pids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_the_plain_engine(client, plain_engine, prompt):
    ref = plain_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text


def test_metrics_show_each_ranks_attention_time_and_the_bubble(hp_app, client):
    base = hp_app[0]
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    deadline = time.monotonic() + 30  # the engine's next report reaches the planner
    while True:
        ranks, bubble = _rank_metrics(base)
        if (set(ranks) == {"0", "1"} and min(ranks.values()) > 0 and bubble > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert set(ranks) == {"0", "1"} and ranks["0"] > 0 and ranks["1"] > 0, ranks
    assert 0 < bubble < sum(ranks.values())


def test_a_dead_follower_fails_the_health_check_and_the_replica_is_replaced(hp_app, client, plain_engine):
    base, _, state = hp_app
    old = _replica_info()
    os.kill(old["follower_pids"][0], signal.SIGKILL)
    handle = engine_handle(HP_APP)
    with pytest.raises(Exception, match="follower ranks exited"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the kill lands at once; the poll sees it then
            handle.check_health.remote().result(timeout_s=30)
            time.sleep(0.1)

    # Serve replaces the replica after a few failed checks (every 10 s); with it go its
    # placement group and what is left of its ranks.
    deadline = time.monotonic() + 180
    new = old
    while new["replica_id"] == old["replica_id"] and time.monotonic() < deadline:
        time.sleep(1)
        try:
            new = _replica_info()
        except Exception:  # between replicas
            pass
    assert new["replica_id"] != old["replica_id"], "Serve did not replace the replica"
    assert _wait_gone(old["follower_pids"]) == []
    assert len(new["follower_pids"]) == 1 and _live(new["follower_pids"]) == new["follower_pids"]
    wait_healthy(base)
    ref = plain_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text

    # Deleting the app stops the live follower rank too.
    serve.delete(HP_APP)
    state["deleted"] = True
    assert _wait_gone(new["follower_pids"]) == []
