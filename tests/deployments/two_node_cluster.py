"""Two engine nodes of a Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``),
run by ``test_serve_two_nodes.py`` in a process of its own (the package's other tests hold a
Ray of their own in theirs).

    head (1 CPU): Serve's controller and proxy, the ingress, the planner
    node A, node B (0 CPUs, one "engine_slot" each): one EngineServer each

Prints one JSON line, the scenario's observations; the test asserts on them. Everything is on
127.0.0.1 and bounded in time; the cluster is shut down on every path.

    python two_node_cluster.py MODEL_PATH PORT
"""

import asyncio
import json
import sys
import time

import httpx

MODEL = "toy"
NUM_STREAMS = 16
STREAM = {"model": MODEL, "prompt": "Hello there", "max_tokens": 240, "min_tokens": 240, "stream": True}
SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "min_tokens": 4}


def app_args(model_path: str) -> dict:
    return {
        "config": "default",
        "model": {"path": model_path, "device": "cpu", "dtype": "float32", "max_model_len": 512},
        "cache": {"kv_cache_gib": 0.02},
        "scheduler": {"max_num_seqs": NUM_STREAMS, "max_num_batched_tokens": 512},
        "serve": {"model_name": MODEL, "num_engine_replicas": 2, "engine_num_cpus": 0,
                  "engine_resources": {"engine_slot": 1}, "stats_interval_s": 0.25, "engine_stale_s": 30,
                  "handle_timeout_s": 30, "token_timeout_s": 30},
    }


def main(model_path: str, port: int) -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from spin_cluster.deployments.app import build_app

    # A removed node is declared dead after ~1 s of failed health checks, not Ray's ~15 s.
    health = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "_system_config": health})
    try:
        nodes = [cluster.add_node(num_cpus=0, resources={"engine_slot": 1}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args(model_path)), name="two", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        return asyncio.run(_scenario(base, nodes, cluster))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


async def _scenario(base: str, nodes: list, cluster) -> dict:
    from ray import serve

    out: dict = {}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        out["health_engines"] = await _wait_engines(http, 2)
        # Both serve: sequential short requests, the planner's pick (most free KV) alternating
        # as each engine's report shows the other with more room.
        out["warm_up"] = [(await http.post("/v1/completions", json=SHORT)).status_code for _ in range(8)]
        await asyncio.sleep(1.0)  # one stats report
        out["requests_by_engine"] = await _engine_counts(http)

        started = asyncio.Queue()
        streams = [asyncio.create_task(_stream(http, started)) for _ in range(NUM_STREAMS)]
        for _ in range(NUM_STREAMS):  # every stream has its first token, on one engine or the other
            await asyncio.wait_for(started.get(), 120)
        # Engines fit only the two engine nodes (an engine_slot each): node A runs one of them.
        cluster.remove_node(nodes[0])
        removed_s = time.monotonic()
        done, pending = await asyncio.wait(streams, timeout=90)
        out["streams_pending"] = len(pending)
        for task in pending:
            task.cancel()
        ends = [t.result() for t in done]
        out["stream_ends"] = [end for end, _ in ends]
        # Seconds from the removal to the last end of each kind.
        out["ended_after_s"] = {kind: max(at - removed_s for end, at in ends if end == kind)
                                for kind in {end for end, _ in ends}}
        out["after"] = [(await http.post("/v1/completions", json=SHORT)).status_code for _ in range(4)]
        out["health_after"] = (await http.get("/health")).json()
    serve.delete("two")
    return out


async def _wait_engines(http: httpx.AsyncClient, count: int, timeout_s: float = 240) -> int:
    deadline = time.monotonic() + timeout_s
    engines = 0
    while time.monotonic() < deadline:
        try:
            engines = (await http.get("/health")).json().get("engines", 0)
        except httpx.HTTPError:
            engines = 0
        if engines >= count:
            break
        await asyncio.sleep(0.5)
    return engines


async def _engine_counts(http: httpx.AsyncClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get("/metrics")).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "spin_engine_requests_total"}


async def _stream(http: httpx.AsyncClient, started: asyncio.Queue) -> tuple[str, float]:
    """How one stream ended, and when (time.monotonic())."""
    return await _stream_end(http, started), time.monotonic()


async def _stream_end(http: httpx.AsyncClient, started: asyncio.Queue) -> str:
    """How one stream ended: "finished" (a finish_reason), an error code, or "closed"."""
    first = True
    async with http.stream("POST", "/v1/completions", json=STREAM) as r:
        if r.status_code != 200:
            started.put_nowait(r.status_code)
            return f"status {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first:
                started.put_nowait(200)
                first = False
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]["code"]
            if event["choices"] and event["choices"][0]["finish_reason"]:
                return "finished"
    return "closed"


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
