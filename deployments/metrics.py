"""Prometheus metrics of one application, on a registry of its own (not the global one).

The ingress owns it. Request latencies and token counts are observed by the ingress as the
tokens stream through it; the engines' gauges and counters are pulled from the planner's
cluster stats when ``/metrics`` is scraped. Every series carries ``model_name``. S-HPLB's
rank times and bubble come from head-parallel engines (``serve.engine_ranks`` > 1) and stay at
zero with one rank per engine; the imbalance is the planner's placement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spin_cluster.deployments.messages import ClusterStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                  50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
# Engine counter key (EngineReport.counters) -> metric name without the _total suffix.
_ENGINE_COUNTERS = {
    "buffer_lookups": ("spin_buffer_lookups", "Selected pages looked up in the GPU buffer."),
    "buffer_hits": ("spin_buffer_hits", "Selected pages found in the GPU buffer."),
    "retrieved_bytes": ("spin_retrieved_bytes", "Bytes retrieved from the host tier into the buffer."),
    "evicted_pages": ("spin_evicted_pages", "Pages evicted from the GPU buffer."),
    "promoted_pages": ("spin_promoted_pages", "Host pages Select picked, retrieved into GPU buffer slots."),
    "spilled_pages": ("spin_spilled_pages", "Pages moved from the GPU to the host tier to make room, coldest first."),
    "preemptions": ("spin_num_preemptions", "Requests preempted (pages freed, recomputed later)."),
    "prefix_cache_queries": ("spin_prefix_cache_queries", "Admitted requests' tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("spin_prefix_cache_hits", "Admitted requests' tokens found in the prefix cache."),
    "attention_bubble_s": ("spin_attention_bubble_seconds", "Seconds ranks waited for the slowest rank."),
}


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]
        reg = self.registry
        self.ttft_s = Histogram("spin_time_to_first_token_seconds", "Arrival to first token.",
                                label, buckets=_TTFT_BUCKETS_S, registry=reg).labels(model_name)
        self.itl_s = Histogram("spin_inter_token_latency_seconds", "Time between output tokens.",
                               label, buckets=_ITL_BUCKETS_S, registry=reg).labels(model_name)
        self.e2e_s = Histogram("spin_e2e_request_latency_seconds", "Arrival to last token.",
                               label, buckets=_E2E_BUCKETS_S, registry=reg).labels(model_name)
        self.prompt_tokens = Counter("spin_prompt_tokens", "Prompt tokens of admitted requests.",
                                     label, registry=reg).labels(model_name)
        self.generation_tokens = Counter("spin_generation_tokens", "Generated tokens.",
                                         label, registry=reg).labels(model_name)
        self._success = Counter("spin_request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self._cluster = _ClusterCollector(model_name)
        reg.register(self._cluster)

    def request(self) -> RequestMetrics:
        return RequestMetrics(self)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self, stats: ClusterStats | None) -> bytes:
        """The exposition text; ``stats`` None keeps the last cluster stats."""
        if stats is not None:
            self._cluster.stats = stats
        return generate_latest(self.registry)


class RequestMetrics:
    """One request's timeline, observed as its outputs pass through the ingress."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._m = metrics
        self._arrival_s = time.monotonic()
        self._last_token_s: float | None = None
        self._done = False

    def admitted(self, num_prompt_tokens: int) -> None:
        self._m.prompt_tokens.inc(num_prompt_tokens)

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last_token_s is None:
            self._m.ttft_s.observe(now - self._arrival_s)
        else:  # one step's gap, shared by the tokens it produced
            gap = (now - self._last_token_s) / num_tokens
            for _ in range(num_tokens):
                self._m.itl_s.observe(gap)
        self._last_token_s = now
        self._m.generation_tokens.inc(num_tokens)

    def finished(self, reason: str | None) -> None:
        if self._done:
            return
        self._done = True
        self._m.e2e_s.observe(time.monotonic() - self._arrival_s)
        self._m.finished(reason or "stop")


class _ClusterCollector(Collector):
    """Engine-side series from the planner's last ClusterStats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = ClusterStats()

    def collect(self) -> Iterator[Metric]:
        st, name = self.stats, self.model_name
        yield _gauge("spin_requests_running", "Requests running in the engines.", st.num_running, name)
        yield _gauge("spin_requests_waiting", "Requests waiting in the engines' queues.", st.num_waiting, name)
        for key, (metric, doc) in _ENGINE_COUNTERS.items():
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], float(st.counters.get(key, 0)))
            yield c
        ranks = CounterMetricFamily("spin_attention_rank_seconds", "Attention seconds per head-parallel rank.",
                                    labels=["model_name", "rank"])
        for rank, seconds in sorted((st.attention_rank_s or {"0": 0.0}).items()):
            ranks.add_metric([name, str(rank)], float(seconds))
        yield ranks
        pages = GaugeMetricFamily("spin_kv_pages", "KV pages by tier and state.",
                                  labels=["model_name", "tier", "state"])
        for (tier, state), n in sorted(_with_tiers(st.kv_pages).items()):
            pages.add_metric([name, tier, state], n)
        yield pages
        kv_bytes = GaugeMetricFamily("spin_kv_bytes", "KV bytes (K and V) by tier and state.",
                                     labels=["model_name", "tier", "state"])
        for (tier, state), n in sorted(_with_tiers(st.kv_bytes).items()):
            kv_bytes.add_metric([name, tier, state], n)
        yield kv_bytes
        allocated = GaugeMetricFamily("spin_kv_allocated_bytes", "Bytes allocated for KV pages by tier, free "
                                      "pages included (host: the host tier's one allocation).",
                                      labels=["model_name", "tier"])
        for tier in sorted({"gpu", "host", *st.allocated_bytes}):
            allocated.add_metric([name, tier], st.allocated_bytes.get(tier, 0))
        yield allocated
        meta = GaugeMetricFamily("spin_metadata_bytes", "Page-table bytes by tier.", labels=["model_name", "tier"])
        for tier in sorted({"gpu", "host", *st.metadata_bytes}):
            meta.add_metric([name, tier], st.metadata_bytes.get(tier, 0))
        yield meta
        yield _gauge("spin_head_placement_imbalance", "Max rank load over mean rank load, minus 1.",
                     st.head_placement_imbalance, name)
        engines = CounterMetricFamily("spin_engine_requests", "Requests each engine replica admitted.",
                                      labels=["model_name", "engine"])
        for replica_id, n in sorted(st.requests_by_engine.items()):
            engines.add_metric([name, replica_id], float(n))
        yield engines


def _gauge(metric: str, doc: str, value: float, model_name: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(metric, doc, labels=["model_name"])
    g.add_metric([model_name], value)
    return g


def _with_tiers(kv_pages: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """Both home tiers and both states always present (zero when a tier is not in use)."""
    out = {(t, s): 0 for t in ("gpu", "host") for s in ("free", "used")}
    out.update(kv_pages)
    return out
