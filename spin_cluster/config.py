"""Engine configuration: one frozen dataclass per subsystem, composed in ``SpinConfig``.

Every field says its unit and range; ``validate`` raises ``ValueError`` telling what to
change. ``SpinConfig.from_dict`` rejects unknown keys so that a typo in a YAML file is an
error, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spin_cluster import env

if TYPE_CHECKING:
    from spin_cluster.models.config import ModelConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelOptions:
    # Folder with config.json + *.safetensors + tokenizer. None: the default model
    # (SmolLM2-135M-Instruct, prepared by `spin-cluster models prepare`).
    path: str | None = None
    # Weights and activations: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.
    dtype: str = "auto"
    # "auto" (cuda if available), "cpu", "cuda", "cuda:N".
    device: str = "auto"
    # Longest prompt + output in tokens; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # Replay decode-only steps as CUDA graphs, one per padded batch size up to
    # scheduler.max_num_seqs, captured at start-up (GPU-only cache on CUDA; elsewhere unused).
    cuda_graphs: bool = True
    # float32 on the CPU: every GEMM's weight prepacked once for oneDNN (a second copy of the
    # weights; SmolLM2's decode step 1.1x faster at batch 1, 2x at batch 4, 1.4x at batch 16).
    # Head-parallel ranks never pack: their split-K shards of o_proj and down_proj would round
    # differently from the one-rank GEMM under oneDNN's blocking. Unused elsewhere.
    cpu_packed_gemms: bool = True
    # "auto": weights from the folder's safetensors; "dummy": random weights at the shapes
    # of its config.json (benchmarks of the system, where the weights do not matter).
    load_format: str = "auto"

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"model.load_format={self.load_format!r}: choose one of {', '.join(_LOAD_FORMATS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len={self.max_model_len}: must be >= 1 or null")

    def resolved_path(self) -> str:
        return self.path or str(env.default_model_dir())


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per physical page; each page holds one (layer, KV head). Power of two, 1..256.
    page_size: int = 16
    # GPU-only cache: bytes of the K+V page pool in GiB; None: 85% of free GPU memory on
    # CUDA, 2 GiB on CPU. Not used when offload is on.
    kv_cache_gib: float | None = None
    # Spin: every page's home is host memory (pinned), the GPU keeps a buffer of page slots.
    offload: bool = False
    # GPU-only cache: requests whose leading tokens equal an earlier request's (a chat
    # template, a system prompt, a repeated prompt) reuse the K/V of its full pages and
    # prefill from there. Idle cached pages count as free and are evicted least recently
    # used first. Ignored with offload (Spin's cache shares no pages).
    enable_prefix_caching: bool = True
    # Host tier size in GiB (offload); None: 8 GiB.
    host_kv_gib: float | None = None
    # GPU buffer share per (request, layer, KV head), in pages, >= the pages a step selects
    # (sink + budget + local); 0: buffer_share times those.
    buffer_pages_per_head: int = 0
    # The share's cap, when buffer_pages_per_head is 0, as a multiple (>= 1) of the pages a
    # step selects: the columns past 1x keep pages that recent steps selected (temporal
    # locality). 0: no cap, a share may grow to the request's every page while the GPU
    # buffer has room (elastic_shares), so KV that fits the GPU is kept there whole.
    buffer_share: float = 0.0
    # Host pages per second-level segment of the page table (offload), power of two 1..1024.
    # The GPU directory is 1/segment_pages of a flat table; a request's last segment may be
    # partly unused (at most segment_pages - 1 host pages per layer and head).
    segment_pages: int = 64
    # Recency buckets of the buffer's LRU, 2..1024.
    lru_buckets: int = 64
    # Size each newcomer's buffer share from the free slots and the queue behind it (down to
    # its mandatory pages); false: every request takes buffer_pages_per_head or waits.
    elastic_shares: bool = True
    # With sparse.per_head_budgets (top-k): size each head's share by its own selection
    # (buffer_share times sink + its budget + local) instead of the widest head's, so a
    # request's share takes a fraction of the slots and more requests fit the same GPU cap.
    per_head_shares: bool = False
    # Keep selected pages in the GPU buffer between steps (temporal locality); false: every
    # page a step selects is retrieved from the host tier again (the no-buffer baseline).
    buffer_reuse: bool = True

    def validate(self) -> None:
        if self.page_size < 1 or self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"cache.page_size={self.page_size}: use a power of two in 1..256")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"cache.enable_prefix_caching={self.enable_prefix_caching!r}: use true or false")
        for name in ("kv_cache_gib", "host_kv_gib"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"cache.{name}={value}: must be > 0 or null")
        if not (self.buffer_share >= 1 or self.buffer_share == 0):
            raise ValueError(f"cache.buffer_share={self.buffer_share}: must be >= 1 (a multiple of the selected "
                             f"pages) or 0 (no cap)")
        if self.buffer_pages_per_head < 0:
            raise ValueError(f"cache.buffer_pages_per_head={self.buffer_pages_per_head}: must be >= 0")
        if self.segment_pages < 1 or self.segment_pages > 1024 or self.segment_pages & (self.segment_pages - 1):
            raise ValueError(f"cache.segment_pages={self.segment_pages}: use a power of two in 1..1024")
        if not 2 <= self.lru_buckets <= 1024:
            raise ValueError(f"cache.lru_buckets={self.lru_buckets}: use 2..1024")


_PREFILL_ALGORITHMS = ("dense", "block")
_PREFILL_ESTIMATORS = ("antidiagonal", "pooled", "strided")
_PREFILL_BUDGETS = ("uniform", "threshold", "per_head")


def _normalize_budget_rows(section, cast, name: str) -> None:
    """``section.per_head_budgets`` ([L][Hkv], any sequences) as a tuple of tuples of
    ``cast`` (hashable, as a frozen config's fields are), every entry >= 0."""
    if section.per_head_budgets is None:
        return
    rows = tuple(tuple(cast(b) for b in row) for row in section.per_head_budgets)
    object.__setattr__(section, "per_head_budgets", rows)
    if any(b < 0 for row in rows for b in row):
        raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class SparsePrefillConfig:
    """``sparse.prefill``: block-sparse attention of prompt chunks (``spin_cluster.sparse.prefill``).

    It changes which scores prefill computes, never what it stores: every prompt token's K/V
    is written, so decode (``sparse.algorithm``) and the memory system work unchanged."""

    # "dense": every causal key (SDPA); "block": block-sparse prefill.
    algorithm: str = "dense"
    # Positions per query block and key block, a power of two in 16..128.
    block_size: int = 64
    # Key-block importance estimate: "antidiagonal" (XAttention: q.k summed along every
    # stride-th antidiagonal), "pooled" (block-mean q . block-mean k) or "strided"
    # (stride-mean q . block-mean k: 1/16 of the antidiagonal estimate's cost or less).
    estimator: str = "antidiagonal"
    # antidiagonal: positions between sampled antidiagonals; strided: queries per pooled
    # group. A power of two dividing block_size.
    stride: int = 8
    # Always-kept first key blocks (attention sinks) and key blocks just left of the diagonal
    # (local band), >= 0. The diagonal block is always kept.
    sink_blocks: int = 1
    local_blocks: int = 1
    # More key blocks per (KV head, query block): "uniform" (budget for every head),
    # "threshold" (the fewest best blocks whose estimated mass, with the kept ones, reaches
    # threshold: XAttention), "per_head" (per_head_budgets, or S-HPLB budgets from profile).
    budgets: str = "uniform"
    # Middle key blocks per query block: a fraction (0, 1) of its middle blocks, or a count >= 1.
    budget: float = 0.25
    # threshold: estimated attention mass to reach, (0, 1].
    threshold: float = 0.9
    # per_head: [L][Hkv] budgets, each with budget's meaning.
    per_head_budgets: tuple[tuple[float, ...], ...] | None = None
    # per_head without per_head_budgets: an S-HPLB head profile (``spin_cluster.hplb``); the
    # heads' needs at `coverage` (0, 1] shift the fraction `budget` between heads (max-min,
    # same total).
    profile: str | None = None
    coverage: float = 0.9

    def validate(self) -> None:
        for name, value, choices in (("algorithm", self.algorithm, _PREFILL_ALGORITHMS),
                                     ("estimator", self.estimator, _PREFILL_ESTIMATORS),
                                     ("budgets", self.budgets, _PREFILL_BUDGETS)):
            if value not in choices:
                raise ValueError(f"sparse.prefill.{name}={value!r}: choose one of {', '.join(choices)}")
        bs = self.block_size
        if not 16 <= bs <= 128 or bs & (bs - 1):
            raise ValueError(f"sparse.prefill.block_size={bs}: use a power of two in 16..128")
        if self.stride < 1 or self.stride & (self.stride - 1) or bs % self.stride:
            raise ValueError(f"sparse.prefill.stride={self.stride}: use a power of two dividing block_size={bs}")
        if self.sink_blocks < 0 or self.local_blocks < 0:
            raise ValueError("sparse.prefill.sink_blocks and local_blocks must be >= 0")
        if not self.budget > 0:
            raise ValueError(f"sparse.prefill.budget={self.budget}: must be > 0 (a fraction, or blocks)")
        for name in ("threshold", "coverage"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"sparse.prefill.{name}={getattr(self, name)}: use a mass in (0, 1]")
        _normalize_budget_rows(self, float, "sparse.prefill.per_head_budgets")
        if self.budgets == "per_head" and self.per_head_budgets is None and self.profile is None:
            raise ValueError("sparse.prefill.budgets='per_head' needs per_head_budgets ([L][Hkv]) or a profile")
        if self.profile is not None and self.budget >= 1:
            raise ValueError(f"sparse.prefill.budget={self.budget}: with a profile give the mean as a fraction in (0, 1)")


@dataclass(frozen=True)
class SparseConfig:
    # Registered algorithm: dense, streaming, ... (`spin_cluster.sparse.registered_algorithms()`).
    algorithm: str = "dense"
    # Middle pages' budget per head: tokens if >= 1, else a fraction (0, 1) of the context.
    budget: float = 2048
    # Always-kept first tokens (attention sinks) and last tokens (local window), >= 0.
    sink_tokens: int = 16
    local_tokens: int = 64
    # The first N decoder layers attend densely (Quest and ShadowKV leave the first layers,
    # whose attention is the least sparse, dense). On the offloaded cache these layers read
    # the whole context from the host tier each decode step (PCIe traffic of N/L of a dense
    # offload step); the other layers select. 0: every layer selects.
    dense_layers: int = 0
    # Optional per-(layer, KV head) budgets in tokens, [L][Hkv]; overrides budget.
    per_head_budgets: tuple[tuple[int, ...], ...] | None = None
    # Online top-p Select in (0, 1]: per step each head takes the fewest top pages whose
    # estimated attention mass reaches top_p, the heads of a layer sharing the pages their
    # budgets add up to (so the buffer reserves that layer total per head). None: top-k.
    top_p: float | None = None
    # Select's hysteresis on the offloaded cache, in nats of estimated attention logit: a
    # page already in the head's GPU buffer share scores as if its logit were this much
    # higher, so a page outside must beat it by a factor e^margin in estimated attention
    # weight to take its place. Near-ties at the budget's edge then stop trading places
    # every step (each trade is a PCIe miss). 0: off.
    resident_margin: float = 0.0
    # Keyword options of the algorithm, e.g. {"gate_path": "gate.safetensors"} for seer,
    # {"outlier_fraction": 0.01} for shadowkv, {"num_clusters": 16} for retroinfer.
    options: dict | None = None
    # Block-sparse prefill; default: dense.
    prefill: SparsePrefillConfig = field(default_factory=SparsePrefillConfig)

    def validate(self) -> None:
        self.prefill.validate()
        if not self.budget > 0:
            raise ValueError(f"sparse.budget={self.budget}: must be > 0 (tokens, or a fraction of the context)")
        if self.sink_tokens < 0 or self.local_tokens < 0:
            raise ValueError("sparse.sink_tokens and sparse.local_tokens must be >= 0")
        if self.dense_layers < 0:
            raise ValueError(f"sparse.dense_layers={self.dense_layers}: must be >= 0 (the first N layers attend densely)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"sparse.top_p={self.top_p}: use a mass in (0, 1], or null for top-k")
        if not self.resident_margin >= 0:
            raise ValueError(f"sparse.resident_margin={self.resident_margin}: must be >= 0 (nats; 0 is off)")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"sparse.options must be a mapping of the algorithm's options, got {self.options!r}")
        _normalize_budget_rows(self, int, "sparse.per_head_budgets")

    def budget_tokens(self, context_tokens: int) -> int:
        return int(self.budget) if self.budget >= 1 else max(1, int(self.budget * context_tokens))


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests running at once (decode batch size), 1..4096.
    max_num_seqs: int = 64
    # Most tokens (prefill chunks + decode tokens) in one step, >= 1.
    max_num_batched_tokens: int = 2048
    # Split long prompts into chunks of at most the step's leftover token budget. When off,
    # a prompt is prefilled in one step, so max_num_batched_tokens must cover max_model_len.
    enable_chunked_prefill: bool = True
    # Pipelined decode: while the GPU runs decode step n+1, the host reads step n's tokens and
    # does its bookkeeping (greedy decode-only batches; the next step's input tokens go from
    # the GPU's argmax to the next step without the host). null: on with CUDA, off on CPU.
    async_decode: bool | None = None

    def validate(self) -> None:
        if self.async_decode not in (None, True, False):
            raise ValueError(f"scheduler.async_decode={self.async_decode!r}: use true, false or null (auto)")
        if not 1 <= self.max_num_seqs <= 4096:
            raise ValueError(f"scheduler.max_num_seqs={self.max_num_seqs}: use 1..4096")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1"
            )


@dataclass(frozen=True)
class SpinConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)

    def __post_init__(self) -> None:
        for sub in (self.model, self.cache, self.scheduler, self.sparse):
            sub.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SpinConfig:
        data = dict(data or {})
        parts = {}
        for f in dataclasses.fields(cls):
            sub = data.pop(f.name, None) or {}
            parts[f.name] = _build(_SECTIONS[f.name], sub, f.name)
        if data:
            raise ValueError(
                f"unknown config section(s) {sorted(data)}; known: {sorted(_SECTIONS)}"
            )
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_model(self, mc: ModelConfig) -> None:
        """Raises ``ValueError`` where this config does not fit the model ``mc`` (its
        ``config.json``): the context, the prefill token budget, per-head budget shapes.
        Cheap (no weights), so a server checks it before it starts anything."""
        context = self.model.max_model_len or mc.max_position_embeddings
        if context > mc.max_position_embeddings:
            raise ValueError(
                f"model.max_model_len={context} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}: lower it, or leave it null for {mc.max_position_embeddings}"
            )
        sc = self.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < context:
            raise ValueError(
                f"without chunked prefill, scheduler.max_num_batched_tokens ({sc.max_num_batched_tokens}) "
                f"must be >= max_model_len ({context})"
            )
        for name, rows in (("sparse.per_head_budgets", self.sparse.per_head_budgets),
                           ("sparse.prefill.per_head_budgets", self.sparse.prefill.per_head_budgets)):
            if rows is not None and (len(rows) != mc.num_layers or any(len(r) != mc.num_kv_heads for r in rows)):
                raise ValueError(f"{name} must be [{mc.num_layers}][{mc.num_kv_heads}] (layers x KV heads) "
                                 "for this model")

    def head_parallel_refusal(self) -> str | None:
        """Why head-parallel ranks (``spin_cluster.parallel``) cannot run this config, or None.

        They run the GPU-only paged cache and the offloaded Spin cache with any Select that
        scores each KV head on its own, and dense prefill; the engine refuses the rest with
        this message, and the serving config checks it before any engine starts."""
        if self.cache.offload and self.sparse.algorithm == "seer":
            return ("head-parallel ranks cannot run seer for now (its gate holds weights per layer and KV head "
                    "of the whole model): use another sparse.algorithm")
        if self.cache.offload and self.sparse.top_p is not None:
            return ("head-parallel ranks cannot run top-p Select (a layer's heads share one budget across ranks): "
                    "set sparse.top_p=null")
        if self.sparse.prefill.algorithm != "dense":
            return "head-parallel ranks support dense prefill only for now: set sparse.prefill.algorithm=dense"
        return None

    def replace(self, **sections: Any) -> SpinConfig:
        """Copy with some sections' fields replaced: ``cfg.replace(model={"path": p})``."""
        parts = {}
        for name, changes in sections.items():
            if name not in _SECTIONS:
                raise ValueError(f"unknown config section {name!r}; known: {sorted(_SECTIONS)}")
            parts[name] = _build(_SECTIONS[name], {**dataclasses.asdict(getattr(self, name)), **changes}, name)
        return dataclasses.replace(self, **parts)


_SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "sparse": SparseConfig,
}
_SUBSECTIONS: dict[type, dict[str, type]] = {SparseConfig: {"prefill": SparsePrefillConfig}}


def _build(kind: type, values: dict[str, Any], section: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"config section {section!r} must be a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in config section {section!r}; known: {sorted(known)}"
        )
    for name, sub in _SUBSECTIONS.get(kind, {}).items():  # nested sections arrive as mappings
        if name in values and not isinstance(values[name], sub):
            values = {**values, name: _build(sub, values[name] or {}, f"{section}.{name}")}
    return kind(**values)
