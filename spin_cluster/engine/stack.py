"""What every process that runs a forward builds, in one order: device and dtype, the model
(its projections fused), the context length, the KV cache and its attention backend, the model
runner.

    stack = build_stack(config, load_model, build_cache, progress=True)

An ``Engine`` (one process, or rank 0 of a head-parallel engine) and a head-parallel
``RankWorker`` both build through here. The ranks' builds must issue the same collectives in
the same order (sharding the model, sizing the cache), and must treat the model alike (the
fusions a decode graph captures): one function for all of them keeps that true when a step is
added, where two copies of the sequence would have to be kept in step by hand. The callables
are what differs: a whole model or a rank's shard, a cache or a rank's share of the heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.device import resolve_device, resolve_dtype
from spin_cluster.engine.model_runner import ModelRunner

# (model path, dtype, device) -> the model (or this rank's shard), weights loaded
LoadModel = Callable[[str, torch.dtype, torch.device], torch.nn.Module]
# (model, dtype, device, max_model_len) -> (kv manager, attention backend)
BuildCache = Callable[[torch.nn.Module, torch.dtype, torch.device, int], tuple[Any, Any]]


@dataclass
class ForwardStack:
    device: torch.device
    dtype: torch.dtype
    path: str  # the model's resolved folder
    model: torch.nn.Module  # projections fused
    max_model_len: int
    kv: Any  # the KV manager
    attention: Any  # its LayerAttention backend
    runner: ModelRunner


def build_stack(config: SpinConfig, load_model: LoadModel, build_cache: BuildCache, *, progress: bool,
                prepare: Callable[[torch.nn.Module], None] | None = None) -> ForwardStack:
    """The stack for ``config``. ``prepare(model)``: a step between the fusion and the cache
    (one process's CPU GEMM packs); a head-parallel rank passes none."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    path = config.model.resolved_path()
    model = load_model(path, dtype, device).fuse_projections()
    if prepare is not None:
        prepare(model)
    mc = model.config
    config.check_model(mc)
    max_model_len = config.context_len(mc)
    kv, attention = build_cache(model, dtype, device, max_model_len)
    graphs = config.scheduler.max_num_seqs if config.model.cuda_graphs else 0
    runner = ModelRunner(model, attention, device, progress=progress, cuda_graph_max_batch=graphs)
    return ForwardStack(device, dtype, path, model, max_model_len, kv, attention, runner)
