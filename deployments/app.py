"""``build_app``: the whole Serve application from one config.

    HTTP ─▶ OpenAIIngress (1) ──route──▶ ClusterPlanner (1)
                  │                               ▲ register / report
                  └── generate(stream, route_to) ─┴─▶ EngineServer (1 per node)

Used three ways: ``spin-cluster serve`` (``local.py``), ``serve.run(build_app(args))`` in
Python and tests, and a Serve deploy config (a KubeRay ``RayService``) whose application
says ``import_path: spin_cluster.deployments.app:build_app`` with the config as ``args``
(``deploy_config`` writes one).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from spin_cluster.deployments.engine_server import EngineServer
from spin_cluster.deployments.ingress import OpenAIIngress
from spin_cluster.deployments.engine_watch import WatchedPlanner
from spin_cluster.deployments.routing import PlannerRouter
from spin_cluster.deployments.settings import START_ATTEMPTS, AppConfig, load_app_config, rank_bundles

IMPORT_PATH = "spin_cluster.deployments.app:build_app"
# Calls that are not requests (checks, stats) may be in flight beside a full queue.
_SPARE_CALLS = 16
_INGRESS_MAX_ONGOING = 4096


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """``args``: {"config": YAML file or bundled name, <section>: overrides} (see settings.py)."""
    config = load_app_config(args)
    config.check_model()  # a deploy fails with the reason, not with replicas that fail to start
    config = config.with_model_context()  # null max_model_len: the model's own context
    opts = config.serve
    engine_options = _engine_placement(config)
    planner = serve.deployment(WatchedPlanner, name="ClusterPlanner").options(
        num_replicas=1,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": opts.planner_num_cpus},
        logging_config={"enable_access_log": False},  # reports every stats_interval_s
        max_constructor_retry_count=START_ATTEMPTS,
    ).bind(config)
    engine = EngineServer.options(
        num_replicas=opts.num_engine_replicas,
        max_ongoing_requests=config.spin.scheduler.max_num_seqs + opts.max_waiting_requests + _SPARE_CALLS,
        **engine_options,
        request_router_config=RequestRouterConfig(request_router_class=PlannerRouter),
        graceful_shutdown_timeout_s=opts.drain_s,
        max_constructor_retry_count=START_ATTEMPTS,
    ).bind(config, planner)
    return OpenAIIngress.options(
        num_replicas=1,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": opts.ingress_num_cpus},
        graceful_shutdown_timeout_s=opts.drain_s,
        max_constructor_retry_count=START_ATTEMPTS,
    ).bind(config, planner, engine)


def _engine_placement(config: AppConfig) -> dict[str, Any]:
    """The EngineServer's resources: one replica per node; with R > 1 head-parallel ranks, a
    placement group per replica instead, one bundle per rank on one node (STRICT_PACK), the
    replica (rank 0) in bundle 0 and its ``RankActor``s in the others (``head_parallel.py``).
    Serve refuses max_replicas_per_node beside bundles; on GPUs, a node fits as many replicas
    as it has GPUs for their ranks."""
    opts = config.serve
    resources = dict(opts.engine_resources or {})
    ranks = config.ranks_per_engine(config.spin.model.checkpoint_config().num_kv_heads)
    if ranks == 1:
        return {"max_replicas_per_node": 1, "ray_actor_options": {
            "num_cpus": opts.engine_num_cpus, "num_gpus": opts.engine_num_gpus, "resources": resources}}
    gpu = opts.engine_num_gpus > 0
    return {
        "placement_group_bundles": rank_bundles(ranks, gpu=gpu, num_cpus=opts.engine_num_cpus, resources=resources),
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": opts.engine_num_cpus, "num_gpus": 1 if gpu else 0, "resources": resources},
    }


def deploy_config(args: dict[str, Any], *, name: str = "spin", route_prefix: str = "/",
                  host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """A Serve deploy config (``serve deploy``, KubeRay ``serveConfigV2``) for this app."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH, "args": dict(args)}
        ],
    }
