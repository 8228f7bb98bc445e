"""The planner's routing and stats, the request router's ranking, and the metrics text,
as plain objects (no Ray cluster)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from prometheus_client.parser import text_string_to_metric_families

from spin_cluster.deployments.messages import ClusterStats, EngineReport
from spin_cluster.deployments.metrics import ServingMetrics
from spin_cluster.deployments.planner import ClusterPlanner
from spin_cluster.deployments.routing import rank_replicas
from spin_cluster.deployments.settings import load_app_config

NOW = 1000.0


def _planner(**serve) -> ClusterPlanner:
    return ClusterPlanner(load_app_config({"config": "spin-quest", "serve": {"engine_stale_s": 5.0, **serve}}))


def _report(rid: str, free: int, at: float = NOW, waiting: int = 0, **counters) -> EngineReport:
    return EngineReport(replica_id=rid, reported_s=at, free_kv_tokens=free, num_waiting=waiting,
                        num_running=1, kv_pages={("host", "free"): free}, counters=counters)


def test_register_hands_out_the_configs_sparse_settings():
    plan = _planner().register("a")
    assert plan.sparse["algorithm"] == "quest" and plan.sparse["budget"] == 256
    assert "per_head_budgets" not in (plan.sparse["options"] or {})
    assert set(plan.head_placement) == {0} and len(plan.head_placement[0]) == 30 * 3  # one rank: every head
    assert plan.imbalance == 0.0


def _smollm2_profile(path, model_path, mass_of=None):
    """A synthetic profile of SmolLM2's 30 x 3 KV heads: head (l, h) recovers mass like
    f ** (1 / (1 + (l + h) % 7)), so heads differ in how many pages they need."""
    from spin_cluster.hplb.profile import FamilyCurves, HeadProfile, model_identity, save_profile

    fractions = np.linspace(0, 1, 17)
    mass = np.array([[fractions ** (1.0 / (1 + (layer + h) % 7)) for h in range(3)] for layer in range(30)])
    identity = model_identity(model_path) if mass_of is None else {"name": "other", **mass_of}
    save_profile(HeadProfile(model=identity, page_size=16, sink_tokens=16, local_tokens=64, queries_per_prompt=4,
                             context_tokens=(4096,), fractions=fractions, families={"all": FamilyCurves(3, mass)}),
                 path)
    return str(path)


def test_a_profile_gives_per_head_budgets_at_the_same_total(tmp_path, smollm2_path):
    profile = _smollm2_profile(tmp_path / "profile.json", smollm2_path)
    planner = _planner(hplb_profile=profile, engine_num_gpus=2)
    plan = planner.register("a")
    budgets = np.array(plan.sparse["options"]["per_head_budgets"])
    assert budgets.shape == (30, 3) and budgets.sum() == 256 * 90  # max-min keeps the total
    assert budgets.min() >= 64 and budgets.max() > 256 and (budgets % 16 == 0).all()  # floors, shifted, pages
    # ... placed on the engine's 2 GPUs (Spin's offloaded cache runs head-parallel): every
    # head once, greedy on the heterogeneous budgets.
    owned = sorted(pair for heads in plan.head_placement.values() for pair in heads)
    assert set(plan.head_placement) == {0, 1} and owned == [(lay, h) for lay in range(30) for h in range(3)]
    assert 0 <= plan.imbalance < 0.5 and planner.cluster_stats().head_placement_imbalance == plan.imbalance


@pytest.mark.parametrize("serve, ranks", [
    ({"engine_num_gpus": 2}, 2),  # one rank per GPU
    ({"engine_ranks": 2}, 2),  # CPU processes
    ({"engine_num_gpus": 8}, 3),  # at most one per KV head: SmolLM2 has 3
])
def test_the_heads_are_placed_on_the_engines_ranks(smollm2_path, serve, ranks):
    planner = ClusterPlanner(load_app_config({"config": "default", "model": {"path": smollm2_path},
                                              "serve": serve}))
    plan = planner.register("a")
    owned = sorted(pair for heads in plan.head_placement.values() for pair in heads)
    assert set(plan.head_placement) == set(range(ranks)) and owned == [(lay, h) for lay in range(30) for h in range(3)]
    assert all(plan.head_placement.values())  # every rank attends with some heads
    # Uniform budgets: the contiguous split, 3 KV heads per layer over the ranks.
    assert plan.imbalance == pytest.approx(2 / 1.5 - 1 if ranks == 2 else 0.0)
    assert planner.cluster_stats().head_placement_imbalance == plan.imbalance


def test_more_ranks_than_kv_heads_are_refused(smollm2_path):
    with pytest.raises(ValueError, match=r"use 1 \.\. 3 ranks"):
        ClusterPlanner(load_app_config({"config": "default", "model": {"path": smollm2_path},
                                        "serve": {"engine_ranks": 4}}))


def test_a_profile_of_another_model_is_refused(tmp_path):
    profile = _smollm2_profile(tmp_path / "other.json", None, mass_of={"num_layers": 30, "config_sha256": "0" * 64})
    with pytest.raises(ValueError, match="spin-cluster profile"):
        _planner(hplb_profile=profile)


def test_routes_to_the_most_free_kv_and_reserves_what_it_routed(monkeypatch):
    monkeypatch.setattr("time.time", lambda: NOW)
    p = _planner()
    assert p.route(100) is None  # nobody reported yet: Serve picks
    p.report(_report("a", 1000))
    p.report(_report("b", 600))
    assert [p.route(300) for _ in range(3)] == ["a", "a", "b"]  # 1000, 700, then 400 < 600
    p.report(_report("a", 1000))  # a fresh report clears a's reservations
    assert p.route(1) == "a"


def test_silent_engines_are_dropped_and_their_counters_kept(monkeypatch):
    clock = [NOW]
    monkeypatch.setattr("time.time", lambda: clock[0])
    p = _planner()
    p.report(_report("a", 10, buffer_hits=5.0))
    p.report(_report("b", 20, at=NOW + 4, buffer_hits=7.0))
    assert p.num_ready() == 2 and p.cluster_stats().counters["buffer_hits"] == 12
    clock[0] = NOW + 6  # a is 6 s silent, b 2 s
    assert [r.replica_id for r in p.live_reports()] == ["b"]
    stats = p.cluster_stats()
    assert stats.num_engines == 1 and stats.counters["buffer_hits"] == 12  # a's 5 retired, not lost
    assert stats.kv_pages == {("host", "free"): 20}
    assert p.route(1) == "b"


def test_allocated_bytes_are_summed_over_live_engines(monkeypatch):
    monkeypatch.setattr("time.time", lambda: NOW)
    p = _planner()
    for rid, host in (("a", 2**30), ("b", 2**31)):
        p.report(dataclasses.replace(_report(rid, 10), allocated_bytes={"host": host, "gpu": 2**20}))
    assert p.cluster_stats().allocated_bytes == {"host": 3 * 2**30, "gpu": 2**21}


def test_a_dead_engine_is_dropped_at_once_and_its_late_reports_ignored(monkeypatch):
    monkeypatch.setattr("time.time", lambda: NOW)
    p = _planner()
    p.register("a", actor_name="SERVE_REPLICA::spin#EngineServer#a")
    p.register("b", actor_name="SERVE_REPLICA::spin#EngineServer#b")
    p.report(_report("a", 10, buffer_hits=5.0))
    p.report(dataclasses.replace(_report("b", 20, buffer_hits=7.0), num_requests_total=3))
    p.engine_died("b")
    assert p.num_ready() == 1 and p.route(1) == "a"
    assert p.engine_actor_names() == {"a": "SERVE_REPLICA::spin#EngineServer#a"}
    p.report(_report("b", 20, buffer_hits=9.0))  # sent before it died
    p.engine_died("b")
    stats = p.cluster_stats()
    assert stats.num_engines == 1 and stats.counters["buffer_hits"] == 12  # b's 7 retired once
    assert stats.requests_by_engine == {"a": 0, "b": 3}  # a gone engine's count stays
    text = ServingMetrics("m").render(stats).decode()
    assert 'spin_engine_requests_total{engine="b",model_name="m"} 3.0' in text


def _replica(rid: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def test_router_ranks_the_planners_pick_first_and_falls_back_to_the_rest():
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert rank_replicas([a, b, c], "b") == [[b], [a, c]]
    assert rank_replicas([a, c], "b") == [[a, c]]  # the pick is gone
    assert rank_replicas([a, b], None) == [[a, b]]
    assert rank_replicas([], "a") == []


def test_metrics_text_has_every_series_at_zero_before_traffic():
    m = ServingMetrics("m")
    fams = {f.name: f for f in text_string_to_metric_families(m.render(None).decode())}
    for name in ("spin_requests_running", "spin_buffer_hits", "spin_attention_rank_seconds",
                 "spin_attention_bubble_seconds", "spin_head_placement_imbalance", "spin_kv_pages",
                 "spin_metadata_bytes", "spin_kv_allocated_bytes", "spin_request_success",
                 "spin_time_to_first_token_seconds"):
        assert fams[name].samples and all(s.labels["model_name"] == "m" for s in fams[name].samples), name
    reasons = {s.labels["finished_reason"] for s in fams["spin_request_success"].samples if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort"}


def test_metrics_follow_a_request_and_the_cluster_stats():
    m = ServingMetrics("m")
    req = m.request()
    req.admitted(5)
    req.tokens(1)
    req.tokens(2)
    req.finished("length")
    stats = ClusterStats(num_engines=1, num_running=3,
                         counters={"buffer_lookups": 10, "buffer_hits": 8, "prefix_cache_queries": 40,
                                   "prefix_cache_hits": 16},
                         attention_rank_s={"0": 1.5, "1": 2.0}, head_placement_imbalance=0.25,
                         allocated_bytes={"host": 2**30, "gpu": 3 * 2**20})
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(m.render(stats).decode()) for s in f.samples}
    assert value[("spin_prompt_tokens_total", (("model_name", "m"),))] == 5
    assert value[("spin_generation_tokens_total", (("model_name", "m"),))] == 3
    assert value[("spin_inter_token_latency_seconds_count", (("model_name", "m"),))] == 2
    assert value[("spin_time_to_first_token_seconds_count", (("model_name", "m"),))] == 1
    assert value[("spin_request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert value[("spin_requests_running", (("model_name", "m"),))] == 3
    assert value[("spin_buffer_hits_total", (("model_name", "m"),))] == 8
    assert value[("spin_prefix_cache_queries_total", (("model_name", "m"),))] == 40
    assert value[("spin_prefix_cache_hits_total", (("model_name", "m"),))] == 16
    assert value[("spin_attention_rank_seconds_total", (("model_name", "m"), ("rank", "1")))] == 2.0
    assert value[("spin_head_placement_imbalance", (("model_name", "m"),))] == 0.25
    assert value[("spin_kv_allocated_bytes", (("model_name", "m"), ("tier", "host")))] == 2**30
    assert value[("spin_kv_allocated_bytes", (("model_name", "m"), ("tier", "gpu")))] == 3 * 2**20
