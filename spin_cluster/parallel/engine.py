"""One rank of a head-parallel engine.

SPMD: every rank runs this engine on the same requests in the same order. The scheduler's
decisions depend only on token counts and on the cache's capacity in token pages, which is
made equal on every rank (the smallest rank's); the logits are identical on every rank
because the attention output is all-reduced before anything else reads it. So every rank
schedules, samples (greedy, or seeded: the same generators) and stops identically, and
collectives always line up.

    import torch
import torch.distributed as dist
    dist.init_process_group("gloo", ...)              # or use launch_generate()
    engine = HeadParallelEngine(cfg, placement)       # placement: HeadPlacement or None
    outs = engine.generate(prompts, SamplingParams(temperature=0))

Supported: the GPU-only paged cache with dense attention, and the offloaded Spin cache with
sparse Select per KV head (``HeadParallelSpinAttention``: uneven heads per layer padded to one
width); dense prefill. Seer (a gate with weights per global head), top-p Select (a layer's
heads share a budget) and block-sparse prefill are refused with a ValueError for now
(``SpinConfig.head_parallel_refusal``).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from spin_cluster.config import SpinConfig
from spin_cluster.engine.cache_builder import build_cache, cache_kind
from spin_cluster.engine.engine import Engine
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS
from spin_cluster.hplb.placement import HeadPlacement
from spin_cluster.hplb.plan import plan_heads
from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy
from spin_cluster.models import ModelConfig
from spin_cluster.parallel.attention import RANK_BACKENDS
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


class HeadParallelEngine(Engine):
    """This process's rank of a head-parallel engine; ``placement`` None places the heads
    with ``default_placement`` (the same on every rank: it depends only on the config).
    ``admission_output_tokens`` is the ``Engine``'s, and must be the same on every rank (the
    ranks schedule alike): ``launch_generate`` and ``RankSpec`` carry it to theirs."""

    # Every rank steps the same schedule in lockstep (collectives inside each step): no
    # step is launched ahead of the host.
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
        group=None,
        decode_attention: str = "auto",
        progress: bool = True,
        buffer_policy: BufferPolicy = DEFAULT_POLICY,
        admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS,
    ) -> None:
        config = config or SpinConfig()
        if not dist.is_initialized():
            raise ValueError(
                "HeadParallelEngine needs torch.distributed initialised (one process per rank); "
                "use spin_cluster.parallel.launch_generate or init_process_group first"
            )
        refusal = config.head_parallel_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        if placement is not None and placement.num_ranks != self.num_ranks:
            raise ValueError(f"the placement is for {placement.num_ranks} ranks, the process group has {self.num_ranks}")
        self.placement = placement
        self._rank_s_total = [0.0] * self.num_ranks
        self._bubble_s_total = 0.0
        super().__init__(config, decode_attention=decode_attention, progress=progress, buffer_policy=buffer_policy,
                         admission_output_tokens=admission_output_tokens)

    def _load_model(self, path: str, progress: bool):
        model = super()._load_model(path, progress and self.rank == 0)
        mc = model.config
        if self.placement is None:
            self.placement = default_placement(self.config, mc, self.num_ranks)
        check_placement(self.placement, mc)
        p = self.placement
        self.kv_heads = p.kv_heads_of(self.rank)  # [L] this rank's KV heads
        shard_attention(model, self.kv_heads, self.group)
        return shard_mlp(model, self.rank, self.num_ranks, self.group)

    def _build_cache(self, decode_attention: str):
        """The cache kind's rank wrapper sizes this rank's cache (the same capacity on every
        rank), the builder builds it and its backend, and the wrapper wraps that backend."""
        kind = cache_kind(self.config, self.model.config)
        if kind not in RANK_BACKENDS:
            raise ValueError(f"head-parallel ranks cannot run the {kind} cache (sliding-window layers on the "
                             "offloaded cache) for now: run one rank, or set cache.kind=paged")
        rank_backend = RANK_BACKENDS[kind]
        config, rank_mc = rank_backend.rank_cache(self.config, self.model.config, self.placement, self.rank,
                                                  self.dtype, self.device, self.max_model_len, self.group)
        kv, inner = build_cache(config, rank_mc, self.dtype, self.device, self.max_model_len, decode_attention,
                                self.buffer_policy)
        self.attention = rank_backend.over(inner, self.kv_heads, self.model.config, self.group)
        return kv, self.attention

    def release_cuda_graphs(self) -> None:
        """Free the decode CUDA graphs (they are captured again if the engine steps on). A
        graph that captured NCCL all-reduces holds resources of the communicator, so a rank
        calls this before ``dist.destroy_process_group``, which otherwise may hang (PyTorch
        issue 115388; on four H200s, two ranks whose graphs were still alive reported their
        results and then never exited)."""
        graphs = self.runner.graphs
        if graphs is not None:
            graphs.release()
            gc.collect()  # the CUDAGraph objects go now, not at some later collection
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

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
