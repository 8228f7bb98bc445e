"""Rank 0 of a head-parallel engine, and what every rank builds alike.

Only rank 0 schedules, as in vLLM's scheduler/worker split. ``HeadParallelEngine`` is an
``Engine`` whose model holds only the attention heads a ``HeadPlacement`` gives rank 0 and
one block of the MLP's intermediate features, and whose cache holds only those heads' pages.
Before each forward it sends the workers (ranks 1..R-1, ``spin_cluster.parallel.worker``) a
``StepPlan``: what its scheduler did to the cache since the last one (pages allocated,
committed, freed, in order) and the step's chunks with their token ids. A worker applies the
calls to its own cache (of the same capacity in token pages) and runs the same forward over
its own heads; the attention's output projection and the MLP's down projection are summed
across ranks inside it, so the logits are whole on every rank, and only rank 0 computes them
and samples. A worker has no scheduler, sampler, tokenizer or grammar, and nothing it does
depends on deciding alike: it cannot drift from rank 0's schedule.

    # every rank: torch.distributed's group, and a gloo group for the plans (launch_generate,
    # start_leader and FollowerRank do this)
    engine = HeadParallelEngine(cfg, placement, control_group=control)   # rank 0
    outs = engine.generate(prompts, SamplingParams(temperature=0))
    engine.stop_workers()
    RankWorker(cfg, placement).serve(control)                           # ranks 1..R-1

One rank (R = 1) needs no control group. Supported: the GPU-only paged cache with dense
attention, and the offloaded Spin cache with sparse Select per KV head
(``HeadParallelSpinAttention``: uneven heads per layer padded to one width); dense prefill.
Seer (a gate with weights per global head), top-p Select (a layer's heads share a budget) and
block-sparse prefill are refused with a ValueError for now (``SpinConfig.head_parallel_refusal``).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine.cache_builder import build_cache, cache_kind
from spin_cluster.engine.engine import Engine
from spin_cluster.engine.model_runner import ModelRunner, load_engine_model
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS, ScheduledChunk
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.hplb.plan import plan_heads
from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy
from spin_cluster.models import ModelConfig
from spin_cluster.parallel.attention import RANK_BACKENDS
from spin_cluster.parallel.plan import STOP, RecordedKV, StepPlan
from spin_cluster.parallel.shard import shard_attention, shard_mlp
from spin_cluster.parallel.timing import bubble_seconds
from spin_cluster.sparse.budget import plan_config


def default_placement(config: SpinConfig, mc: ModelConfig, num_ranks: int, method: str = "greedy") -> HeadPlacement:
    """Place heads by the costs of the configured budgets: ``sparse.options.per_head_budgets`` if set,
    else ``sparse.budget`` for every head (uniform costs: the contiguous split). On the
    offloaded cache, whose rank width is the most heads a rank owns in a layer, greedy gives
    every rank at most the contiguous split's ceil(Hkv / R) heads per layer."""
    return plan_heads(None, plan_config(config, mc, method=method), num_ranks).placement


def check_placement(p: HeadPlacement, mc: ModelConfig) -> None:
    """Raises ``ValueError`` unless the placement fits the model's heads and gives every rank
    a KV head in some layer."""
    if (p.num_layers, p.num_kv_heads) != (mc.num_layers, mc.num_kv_heads):
        raise ValueError(
            f"the placement is [{p.num_layers}][{p.num_kv_heads}] (layers x KV heads), "
            f"the model has [{mc.num_layers}][{mc.num_kv_heads}]"
        )
    idle = [r for r in range(p.num_ranks) if not any(p.kv_heads_of(r))]
    if idle:
        raise ValueError(f"the placement gives ranks {idle} no KV head in any layer; use fewer ranks")


def check_rank(config: SpinConfig, placement: HeadPlacement | None, group=None) -> tuple[int, int]:
    """(this process's rank, the number of ranks) in ``group``; raises ``ValueError`` where
    head-parallel ranks cannot run ``config`` or ``placement`` (before any weight loads)."""
    if not dist.is_initialized():
        raise ValueError(
            "head-parallel ranks need torch.distributed initialised (one process per rank); "
            "use spin_cluster.parallel.launch_generate or init_process_group first"
        )
    refusal = config.head_parallel_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    num_ranks = dist.get_world_size(group)
    if placement is not None and placement.num_ranks != num_ranks:
        raise ValueError(f"the placement is for {placement.num_ranks} ranks, the process group has {num_ranks}")
    return dist.get_rank(group), num_ranks


def load_rank_model(config: SpinConfig, path: str, placement: HeadPlacement | None, rank: int, num_ranks: int,
                    dtype: torch.dtype, device: torch.device, progress: bool, group=None):
    """(rank ``rank``'s shard of the config's model at ``path``, the placement): ``placement``
    None places the heads with ``default_placement`` (the same on every rank: it depends only
    on the config)."""
    model = load_engine_model(config, path, dtype, device, progress)
    mc = model.config
    placement = placement or default_placement(config, mc, num_ranks)
    check_placement(placement, mc)
    shard_attention(model, placement.kv_heads_of(rank), group)
    return shard_mlp(model, rank, num_ranks, group), placement


def build_rank_cache(config: SpinConfig, mc: ModelConfig, placement: HeadPlacement, rank: int, dtype: torch.dtype,
                     device: torch.device, max_model_len: int, decode_attention: str, buffer_policy: BufferPolicy,
                     group=None):
    """(kv manager, attention backend) of rank ``rank``: the cache kind's rank wrapper sizes
    the rank's cache (the same capacity on every rank: a collective), the builder builds it
    and its backend, and the wrapper wraps that backend."""
    kind = cache_kind(config, mc)
    if kind not in RANK_BACKENDS:
        raise ValueError(f"head-parallel ranks cannot run the {kind} cache (sliding-window layers on the "
                         "offloaded cache) for now: run one rank, or set cache.kind=paged")
    rank_backend = RANK_BACKENDS[kind]
    rank_config, rank_mc = rank_backend.rank_cache(config, mc, placement, rank, dtype, device, max_model_len, group)
    kv, inner = build_cache(rank_config, rank_mc, dtype, device, max_model_len, decode_attention, buffer_policy)
    return kv, rank_backend.over(inner, placement.kv_heads_of(rank), mc, group)


def release_cuda_graphs(runner: ModelRunner, device: torch.device) -> None:
    """Free a rank's decode CUDA graphs (they are captured again if it steps on). A graph that
    captured NCCL all-reduces holds resources of the communicator, so a rank calls this before
    ``dist.destroy_process_group``, which otherwise may hang (PyTorch issue 115388; on four
    H200s, two ranks whose graphs were still alive reported their results and then never
    exited)."""
    if runner.graphs is not None:
        runner.graphs.release()
        gc.collect()  # the CUDAGraph objects go now, not at some later collection
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class HeadParallelEngine(Engine):
    """Rank 0 of a head-parallel engine, driven as an ``Engine``: it schedules, samples and
    sends each step's plan to ranks 1..R-1 over ``control_group`` (gloo, every rank; None
    with one rank). ``placement`` None places the heads with ``default_placement``."""

    # Rank 0 steps in lockstep with its workers (collectives inside each step): no step is
    # launched ahead of the host.
    supports_async_decode = False
    # A rank's shards of o_proj and down_proj sum K-slices of the whole GEMM: through MKL they
    # round as one rank's GEMM does (the same tokens at any rank count); prepacked for oneDNN,
    # its blocking rounds them differently.
    packs_cpu_gemms = False

    def __init__(
        self,
        config: SpinConfig | None = None,
        placement: HeadPlacement | None = None,
        *,
        control_group=None,
        group=None,
        decode_attention: str = "auto",
        progress: bool = True,
        buffer_policy: BufferPolicy = DEFAULT_POLICY,
        admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS,
    ) -> None:
        config = config or SpinConfig()
        self.rank, self.num_ranks = check_rank(config, placement, group)
        if self.rank != 0:
            raise ValueError(f"HeadParallelEngine is rank 0's; rank {self.rank} runs a "
                             "spin_cluster.parallel.worker.RankWorker")
        if self.num_ranks > 1 and control_group is None:
            raise ValueError(f"rank 0 of {self.num_ranks} ranks sends its plans over a control_group "
                             "(a gloo group of every rank); launch_generate and start_leader make one")
        self.group = group
        self.placement = placement
        self._control = control_group
        self._rank_s_total = [0.0] * self.num_ranks
        self._bubble_s_total = 0.0
        self.num_plans_sent = 0
        super().__init__(config, decode_attention=decode_attention, progress=progress, buffer_policy=buffer_policy,
                         admission_output_tokens=admission_output_tokens)
        # The scheduler's calls that change the cache are recorded for the workers' caches.
        self.scheduler.kv = self._recorded = RecordedKV(self.kv)

    def _load_model(self, path: str, dtype: torch.dtype, device: torch.device, progress: bool):
        model, self.placement = load_rank_model(self.config, path, self.placement, self.rank, self.num_ranks,
                                                dtype, device, progress, self.group)
        return model

    def _build_cache(self, model, dtype: torch.dtype, device: torch.device, max_model_len: int, decode_attention: str):
        kv, self.attention = build_rank_cache(self.config, model.config, self.placement, self.rank, dtype, device,
                                              max_model_len, decode_attention, self.buffer_policy, self.group)
        return kv, self.attention

    def _run(self, chunks: list[ScheduledChunk], num_tokens: int, t0: float, num_preempted: int):
        """Rank 0's step, once the workers have this step's plan."""
        if chunks and self._control is not None:
            plan = StepPlan.of(self._recorded.take(), chunks)
            dist.broadcast_object_list([plan], src=0, group=self._control)
            self.num_plans_sent += 1
        return super()._run(chunks, num_tokens, t0, num_preempted)

    def stop_workers(self) -> None:
        """Tell the workers to leave their ``serve`` loop (from the thread that steps, or once
        it has stopped: the control group is not shared between threads)."""
        if self._control is not None:
            dist.broadcast_object_list([STOP], src=0, group=self._control)

    def release_cuda_graphs(self) -> None:
        """``release_cuda_graphs`` of this rank: before it leaves the process group."""
        release_cuda_graphs(self.runner, self.device)

    def _cache_stats(self, counters: list[int] | None = None) -> dict:
        stats = super()._cache_stats(counters)
        rank_layer_s = self.attention.pop_rank_layer_s()  # [R][L] or None (no forward this step)
        rank_s = [sum(t) for t in rank_layer_s] if rank_layer_s else [0.0] * self.num_ranks
        bubble_s = bubble_seconds(rank_layer_s) if rank_layer_s else 0.0
        self._rank_s_total = [a + b for a, b in zip(self._rank_s_total, rank_s)]
        self._bubble_s_total += bubble_s
        return {
            **stats,
            "attention_rank_s": tuple(rank_s),
            "attention_bubble_s": bubble_s,
            "attention_rank_s_total": {str(r): s for r, s in enumerate(self._rank_s_total)},
            "attention_bubble_s_total": self._bubble_s_total,
        }
