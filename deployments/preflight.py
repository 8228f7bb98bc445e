"""What local mode (``spin-cluster serve``) checks before it starts Ray: the config against the
model (``AppConfig.check_model``) and against this machine, the one that will run every
deployment. A config that cannot run fails here with one ``ValueError`` naming the field,
instead of Ray starting and an engine replica failing, or waiting for ever to be placed.

    the algorithm   a registered name, options it takes, the cache it runs on
    Ray's node      one engine replica, no custom resources, CPUs within local Ray's
    GPUs            engine GPUs and head-parallel ranks within torch.cuda.device_count()
    the model       AppConfig.check_model: context, budgets, per-head shapes, KV heads
    memory          the host KV tier (and a CPU page pool) within MemAvailable
    the placement   the planner's plan (S-HPLB profile, heads on ranks), as the app makes it
"""

from __future__ import annotations

from pathlib import Path

from spin_cluster.deployments.settings import AppConfig
from spin_cluster.engine.cache_builder import check_sparse_algorithm
from spin_cluster.models.config import ModelConfig

MEMINFO = Path("/proc/meminfo")


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
    """The host tier's pages are pinned on CUDA (never swapped out) and plain memory on the
    CPU: either way the whole tier is written at start-up, so it must fit the memory the
    machine has available, not its total."""
    total, available = memory_bytes()
    cc = config.spin.cache
    if cc.offload:
        need, field = _host_tier_bytes(config, mc), f"cache.host_kv_gib={cc.host_kv_gib}"
    elif engine_device_type(config) == "cpu" and cc.kv_cache_gib is not None:
        need, field = cc.kv_cache_gib * 2**30, f"cache.kv_cache_gib={cc.kv_cache_gib}"
    else:
        return
    if need > available:
        raise ValueError(f"{field}: the KV pages would take {need / 2**30:.1f} GiB and this machine has "
                         f"{available / 2**30:.1f} GiB available (of {total / 2**30:.1f} GiB): lower it")


def _host_tier_bytes(config: AppConfig, mc: ModelConfig) -> int:
    import torch

    from spin_cluster.engine.cache_builder import host_dtype, host_tier_segments
    from spin_cluster.kvcache.host_tier import HostTier

    spin = config.spin
    dtype_name = spin.model.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if engine_device_type(config) == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    context = spin.model.max_model_len or mc.context_len
    segments = host_tier_segments(spin, mc, dtype, context)
    return segments * HostTier.bytes_per_segment(spin.cache.segment_pages, spin.cache.page_size, mc.head_dim,
                                                 host_dtype(spin, dtype))


def memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes, from /proc/meminfo."""
    fields = {}
    for line in MEMINFO.read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024  # kB
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


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

