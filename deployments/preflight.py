"""What local mode (``spin-cluster serve``) checks before it starts Ray: the config against the
model (``AppConfig.check_model``) and against this machine, the one that will run every
deployment. A config that cannot run fails here with one ``ValueError`` naming the field,
instead of Ray starting and an engine replica failing, or waiting for ever to be placed.

    the algorithm   a registered name, options it takes, the cache it runs on
    Ray's node      one engine replica, no custom resources, CPUs within local Ray's
    GPUs            engine GPUs and head-parallel ranks within torch.cuda.device_count()
    the model       AppConfig.check_model: context, budgets, per-head shapes, KV heads
    memory          memory_plan.py: the host KV tier, a CPU page pool, the weights and the
                    processes within the room under Ray's kill threshold (and a cgroup limit)
    the placement   the planner's plan (S-HPLB profile, heads on ranks), as the app makes it
"""

from __future__ import annotations

from spin_cluster.deployments.memory_plan import MemoryPlan, check_plan, node_room
from spin_cluster.deployments.settings import AppConfig
from spin_cluster.engine.cache_builder import check_sparse_algorithm
from spin_cluster.kvcache.sizing import CPU_DEFAULT_KV_GIB, DEFAULT_HOST_KV_GIB
from spin_cluster.models.config import ModelConfig


def check_local_run(config: AppConfig, local_num_cpus: int) -> None:
    """Raises ``ValueError`` where ``config`` cannot run on this machine as one local Ray node
    of ``local_num_cpus`` logical CPUs."""
    # What needs no model first: reading its config imports transformers (seconds).
    check_sparse_algorithm(config.spin)
    _check_ray_node(config, local_num_cpus)
    _check_gpus(config)
    config.check_model()
    mc = config.spin.model.checkpoint_config()
    _check_memory(config, mc)
    _check_plan(config, mc)


def engine_device_type(config: AppConfig) -> str:
    """The device an engine replica runs on in local mode: Ray hides every GPU from a replica
    that it gives none (``serve.engine_num_gpus`` 0), so ``auto`` means the CPU there."""
    device = config.spin.model.device
    if device == "auto":
        return "cuda" if config.serve.engine_num_gpus > 0 else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def _check_ray_node(config: AppConfig, local_num_cpus: int) -> None:
    serve = config.serve
    if serve.num_engine_replicas != 1:
        raise ValueError(f"serve.num_engine_replicas={serve.num_engine_replicas}: local mode runs one Ray node "
                         "and one engine replica per node: set 1")
    wanted = sorted(name for name, amount in (serve.engine_resources or {}).items() if amount > 0)
    if wanted:
        raise ValueError(f"serve.engine_resources={serve.engine_resources!r}: the local Ray node offers no "
                         f"resource {wanted[0]!r}, so no engine would be placed: leave it null")
    cpus = serve.engine_num_cpus + serve.ingress_num_cpus + serve.planner_num_cpus
    if cpus > local_num_cpus:
        raise ValueError(f"serve.engine_num_cpus={serve.engine_num_cpus:g}: with the ingress and the planner the app "
                         f"needs {cpus:g} of the local Ray node's {local_num_cpus} logical CPUs: lower it")


def _check_gpus(config: AppConfig) -> None:
    import torch

    serve, gpus = config.serve, torch.cuda.device_count()
    ranks = serve.engine_ranks
    # On the CPU (engine_num_gpus 0) ranks are processes; check_model holds them to the KV heads.
    if ranks is not None and ranks > 1 and engine_device_type(config) == "cuda" and ranks > gpus:
        raise ValueError(f"serve.engine_ranks={ranks}: each head-parallel rank on CUDA takes a GPU of its own "
                         f"and this machine has {gpus}: lower it, or run the ranks on the CPU (engine_num_gpus 0)")
    if serve.engine_num_gpus > gpus:
        raise ValueError(f"serve.engine_num_gpus={serve.engine_num_gpus:g}: this machine has {gpus} GPU(s), so Ray "
                         "would never place an engine: lower it")


def _check_memory(config: AppConfig, mc: ModelConfig) -> None:
    """The memory plan (``memory_plan.py``) against this machine's room under Ray's kill
    threshold. The host tier's pages are pinned on CUDA and plain memory on the CPU; either
    way the whole tier is written at start-up, so it is resident from the first request."""
    plan = memory_plan(config, mc)
    cc = config.spin.cache
    if cc.kind == "offloaded":
        setting, part = _gib_setting("cache.host_kv_gib", cc.host_kv_gib, DEFAULT_HOST_KV_GIB), plan.host_tier_bytes
    elif plan.page_pool_bytes:
        setting, part = _gib_setting("cache.kv_cache_gib", cc.kv_cache_gib, CPU_DEFAULT_KV_GIB), plan.page_pool_bytes
    else:
        setting, part = f"model.path={config.spin.model.resolved_path()!r}", plan.weight_bytes
    check_plan(plan, node_room(), setting, part)


def _gib_setting(name: str, value: float | None, default: float) -> str:
    return f"{name}={value:g}" if value is not None else f"{name}=null ({default:g} GiB)"


def memory_plan(config: AppConfig, mc: ModelConfig) -> MemoryPlan:
    """The app's bytes in this machine's memory, as the engine will allocate them."""
    import torch

    from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY
    from spin_cluster.kvcache.sizing import gpu_budget_bytes, host_tier_bytes
    from spin_cluster.models.loader import weight_bytes

    spin, on_cpu = config.spin, engine_device_type(config) == "cpu"
    dtype = _engine_dtype(config)
    context = spin.context_len(mc)
    # Head-parallel ranks on the CPU are processes of their own, each with the weights.
    ranks = config.ranks_per_engine(mc.num_kv_heads) if on_cpu else 0
    return MemoryPlan(
        host_tier_bytes=(host_tier_bytes(spin, mc, dtype, context, DEFAULT_POLICY.segment_pages)
                         if spin.cache.kind == "offloaded" else 0),
        page_pool_bytes=int(gpu_budget_bytes(spin, torch.device("cpu"), activation_bytes=0)) if on_cpu else 0,
        weight_bytes=ranks * weight_bytes(mc, dtype),
    )


def _engine_dtype(config: AppConfig):
    import torch

    name = config.spin.model.dtype
    if name == "auto":
        name = "bfloat16" if engine_device_type(config) == "cuda" else "float32"
    return getattr(torch, name)


def _check_plan(config: AppConfig, mc: ModelConfig) -> None:
    """The planner's own plan (``ClusterPlanner.plan_engines``): the S-HPLB profile against the
    model, and a placement that gives every head-parallel rank a KV head."""
    from spin_cluster.deployments.planner import ClusterPlanner
    from spin_cluster.hplb.placement import HeadPlacement
    from spin_cluster.parallel.engine import check_placement

    serve = config.serve
    try:
        plan = ClusterPlanner(config.with_model_context()).plan
    except ValueError as e:
        raise ValueError(f"serve.hplb_profile={serve.hplb_profile!r}: {e}" if serve.hplb_profile else str(e)) from None
    try:
        check_placement(HeadPlacement.from_rank_heads(plan.head_placement), mc)
    except ValueError as e:
        raise ValueError(f"serve.engine_ranks={config.ranks_per_engine(mc.num_kv_heads)}: {e}") from None

