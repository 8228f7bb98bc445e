"""``ClusterPlanner``: one per application. Plans the engines, routes requests, sums stats.

    EngineServer ──register(replica_id)──▶ planner ──EnginePlan──▶ EngineServer
    EngineServer ──report(EngineReport), every stats_interval_s──▶ planner
    ingress ──route(demand_tokens)──▶ planner ──replica id (most free KV tokens)──▶ ingress
    ingress ──cluster_stats()──▶ planner ──ClusterStats──▶ /metrics

Routing: the live engine with the most free KV tokens, less the tokens already routed to it
since its last report (so a burst between two reports spreads instead of piling on one).
An engine silent for ``serve.engine_stale_s`` is dropped, and one whose replica died as soon
as ``engine_watch`` sees it; its counters are kept so that the exported sums never go backwards.
"""

from __future__ import annotations

import time
from collections import Counter

from spin_cluster.deployments.messages import ClusterStats, EnginePlan, EngineReport
from spin_cluster.deployments.settings import AppConfig
from spin_cluster.hplb import plan_heads
from spin_cluster.hplb.profile import load_profile
from spin_cluster.sparse import get_algorithm
from spin_cluster.sparse.budget import plan_config


class ClusterPlanner:
    def __init__(self, config: AppConfig) -> None:
        self._config = config
        self._stale_s = config.serve.engine_stale_s
        self.plan = self.plan_engines()
        self._reports: dict[str, EngineReport] = {}
        self._reserved_tokens: Counter[str] = Counter()
        self._retired_counters: Counter[str] = Counter()
        self._retired_rank_s: Counter[str] = Counter()
        self._actor_names: dict[str, str] = {}
        self._requests_by_engine: dict[str, int] = {}
        self._dead: set[str] = set()

    def plan_engines(self) -> EnginePlan:
        """S-HPLB for the whole cluster, decided once. With ``serve.hplb_profile``, the offline
        per-head profile turns the uniform ``sparse.budget`` into per-head budgets at the same
        total (max-min shifting, each head kept at ``serve.hplb_floor_fraction`` of uniform or
        more). Either way the budgets' costs place each engine's heads on its head-parallel
        ranks (``AppConfig.ranks_per_engine``: ``serve.engine_ranks``, by default one per GPU)
        by greedy partitioning; the engines run exactly this placement (one rank: every head
        on rank 0, the plain engine), and its imbalance is exported."""
        spin, serve = self._config.spin, self._config.serve
        model_path = spin.model.resolved_path()
        mc = spin.model.checkpoint_config()
        profile = None
        if serve.hplb_profile and not get_algorithm(spin.sparse.algorithm).selects_all:
            profile = load_profile(serve.hplb_profile, model_path=model_path)
        # The uniform budget and the floor rounded down to whole pages (the uniform to one at least).
        config = plan_config(spin, mc, floor_fraction=serve.hplb_floor_fraction, rounding="down")
        plan = plan_heads(profile, config, self._config.ranks_per_engine(mc.num_kv_heads))
        sparse = spin.replace(sparse=plan.sparse_options(spin.sparse.options)).sparse
        return EnginePlan(sparse=sparse.model_dump(), head_placement=plan.placement.to_rank_heads(),
                          imbalance=plan.imbalance)

    # ---- engines ------------------------------------------------------------------------

    def register(self, replica_id: str, actor_name: str | None = None) -> EnginePlan:
        """``actor_name``: the replica's Ray actor, which ``engine_watch`` probes for death."""
        self._reports.setdefault(replica_id, EngineReport(replica_id=replica_id, reported_s=0.0))
        if actor_name is not None:
            self._actor_names[replica_id] = actor_name
        return self.plan

    def report(self, report: EngineReport) -> None:
        if report.replica_id in self._dead:
            return  # sent before its replica died, delivered after
        self._reports[report.replica_id] = report
        self._reserved_tokens.pop(report.replica_id, None)
        self._requests_by_engine[report.replica_id] = report.num_requests_total

    def engine_died(self, replica_id: str) -> None:
        """Drop a dead engine now rather than after ``engine_stale_s`` of silence."""
        self._dead.add(replica_id)
        self._actor_names.pop(replica_id, None)
        rep = self._reports.get(replica_id)
        if rep is not None:
            self._retire(rep)

    def engine_actor_names(self) -> dict[str, str]:
        """Replica id -> Ray actor name of every engine that registered and has not died."""
        return dict(self._actor_names)

    def live_reports(self, now_s: float | None = None) -> list[EngineReport]:
        self._retire_stale(time.time() if now_s is None else now_s)
        return [r for r in self._reports.values() if r.reported_s > 0]

    def num_ready(self) -> int:
        return len(self.live_reports())

    def _retire_stale(self, now_s: float) -> None:
        for rep in list(self._reports.values()):
            registered_only = rep.reported_s == 0
            if not registered_only and now_s - rep.reported_s > self._stale_s:
                self._retire(rep)

    def _retire(self, rep: EngineReport) -> None:
        """Keeps its counters, so that exported totals never go back. Serve runs the sync
        methods on a thread pool, so two calls may retire one engine: the pop makes it once."""
        if self._reports.pop(rep.replica_id, None) is None:
            return
        self._retired_counters.update(rep.counters)
        self._retired_rank_s.update(rep.attention_rank_s)
        self._reserved_tokens.pop(rep.replica_id, None)

    # ---- routing ------------------------------------------------------------------------

    def route(self, demand_tokens: int) -> str | None:
        """The replica id to run a request of ``demand_tokens`` (prompt + output); None when
        no engine has reported yet (Serve's own routing then picks one)."""
        live = self.live_reports()
        if not live:
            return None
        best = max(live, key=lambda r: (r.free_kv_tokens - self._reserved_tokens[r.replica_id], -r.num_waiting))
        self._reserved_tokens[best.replica_id] += max(0, demand_tokens)
        return best.replica_id

    # ---- stats --------------------------------------------------------------------------

    def cluster_stats(self) -> ClusterStats:
        live = self.live_reports()
        kv_pages: Counter = Counter()
        kv_bytes: Counter = Counter()
        metadata: Counter[str] = Counter()
        allocated: Counter[str] = Counter()
        counters = Counter(self._retired_counters)
        rank_s = Counter(self._retired_rank_s)
        for r in live:
            kv_pages.update(r.kv_pages)
            kv_bytes.update(r.kv_bytes)
            metadata.update(r.metadata_bytes)
            allocated.update(r.allocated_bytes)
            counters.update(r.counters)
            rank_s.update(r.attention_rank_s)
        return ClusterStats(
            num_engines=len(live),
            num_running=sum(r.num_running for r in live),
            num_waiting=sum(r.num_waiting for r in live),
            kv_pages=dict(kv_pages),
            kv_bytes=dict(kv_bytes),
            metadata_bytes=dict(metadata),
            allocated_bytes=dict(allocated),
            counters=dict(counters),
            attention_rank_s=dict(rank_s),
            head_placement_imbalance=self.plan.imbalance,
            requests_by_engine=dict(self._requests_by_engine),
        )
