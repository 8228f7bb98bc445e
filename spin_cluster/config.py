"""Engine configuration: one frozen pydantic model per subsystem, composed in ``SpinConfig``.

Every field says its unit and range (``Field(description=...)``, with its bounds as ``ge``/
``gt``/``le`` constraints); checks that span fields are ``model_validator``s. Every section
forbids unknown keys, so that a typo in a YAML file is an error, not a silently ignored
setting, a key that moved is an error naming its new place, and one that is gone an error
saying what became of it. ``SpinConfig.from_dict`` turns a validation failure into one
``ValueError`` line naming the field and what to change (``config_error``). An algorithm's
own options (``sparse.options``, ``sparse.prefill.options``) are typed per algorithm, the
model chosen by its name (``parse_options``). Those readers live in ``config_parse`` and are
importable from here too; the decode algorithms' option models live in ``algorithm_options``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from spin_cluster import env
from spin_cluster.algorithm_options import OPTIONS, budget_rows, check_budget_rows
# The readers are importable from here too (``from spin_cluster.config import option_pairs``).
from spin_cluster.config_parse import config_error, option_pairs, parse_config, parse_options  # noqa: F401

if TYPE_CHECKING:
    from spin_cluster.models.config import ModelConfig


class ConfigSection(BaseModel):
    """A frozen section of the config that refuses keys it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Keys that moved: old key -> its place under this section, which the error names.
    moved_keys: ClassVar[dict[str, str]] = {}
    # Keys that are gone: old key -> the error's whole line, which says what became of it.
    retired_keys: ClassVar[dict[str, str]] = {}


def _power_of_two(value: int, low: int, high: int) -> int:
    if not low <= value <= high or value & (value - 1):
        raise ValueError(f"use a power of two in {low}..{high}")
    return value


class ModelOptions(ConfigSection):
    retired_keys: ClassVar[dict[str, str]] = {
        "cpu_packed_gemms": "model.cpu_packed_gemms is no longer a setting: float32 GEMMs on the CPU are always "
                            "prepacked for oneDNN (faster at every batch measured: SmolLM2's decode step 1.1x at "
                            "batch 1, 2x at batch 4, 1.4x at batch 16); remove it",
    }

    path: str | None = Field(None, description=(
        "Folder with config.json + *.safetensors + tokenizer. null: the default model "
        "(SmolLM2-135M-Instruct, prepared by `spin-cluster models prepare`)."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weights and activations: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16."))
    device: str = Field("auto", description='"auto" (cuda if available), "cpu", "cuda", "cuda:N".')
    max_model_len: int | None = Field(None, ge=1, description=(
        "Longest prompt + output in tokens, >= 1; null: the model's context (max_position_embeddings, "
        "or with YaRN RoPE scaling, factor x original_max_position_embeddings where that is longer)."))
    hf_overrides: dict[str, Any] | None = Field(None, description=(
        "Keys of the model's config.json replaced at load time, as vLLM's --hf-overrides. E.g. "
        "Qwen2.5's 128K context: {rope_scaling: {type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 32768}} (YaRN scales every length alike, so its model "
        "card advises it only where contexts pass 32K)."))
    cuda_graphs: StrictBool = Field(True, description=(
        "Replay decode-only steps as CUDA graphs, one per padded batch size up to "
        "scheduler.max_num_seqs, captured at start-up (GPU-only cache on CUDA; elsewhere unused)."))
    # cpu_packed_gemms is no setting: prepacked float32 CPU GEMMs measured faster at every batch.
    load_format: Literal["auto", "dummy"] = Field("auto", description=(
        '"auto": weights from the folder\'s safetensors; "dummy": random weights at the shapes '
        "of its config.json (benchmarks of the system, where the weights do not matter)."))

    def resolved_path(self) -> str:
        return self.path or str(env.default_model_dir())

    def checkpoint_config(self) -> ModelConfig:
        """The model's config.json as the engine reads it, hf_overrides applied."""
        from spin_cluster.models.config import ModelConfig

        return ModelConfig.from_folder(self.resolved_path(), self.hf_overrides)


class CacheConfig(ConfigSection):
    retired_keys: ClassVar[dict[str, str]] = {
        "offload": "cache.offload is now cache.kind: offloaded (offload true) or paged (offload false)",
        **{key: (f"cache.{key} is no longer a setting: the GPU buffer's mechanisms keep their defaults "
                 "(studies move them through spin_cluster.kvcache.buffer_policy.BufferPolicy); remove it")
           for key in ("buffer_pages_per_head", "per_head_shares", "elastic_shares", "buffer_reuse", "segment_pages")},
        "lru_buckets": "cache.lru_buckets is no longer a setting (the GPU buffer's LRU keeps 64 recency buckets); "
                       "remove it",
    }

    kind: Literal["paged", "offloaded"] = Field("paged", description=(
        '"paged": every page in GPU memory (dense attention only). "offloaded": Spin, every page\'s '
        "home in host memory (pinned) or on the GPU while it has room, the GPU keeping a buffer "
        "of page slots for the host pages a sparse algorithm selects. A model with sliding-window "
        "layers (Gemma 3) takes the hybrid cache under offloaded: its window layers paged, its "
        "full-attention layers offloaded."))
    page_size: int = Field(16, description=(
        "Tokens per physical page; each page holds one (layer, KV head). Power of two, 1..256."))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description=(
        "The share of the GPU's total memory the engine may use, in (0, 1], as vLLM's "
        "gpu_memory_utilization: the weights, a full step's activations and the KV cache "
        "together, so the KV cache gets what the model leaves of it (the rest of the GPU is "
        "left to the CUDA context and other processes). Used when kv_cache_gib is null; unused "
        "on the CPU (2 GiB)."))
    kv_cache_gib: float | None = Field(None, gt=0, description=(
        "GPU memory of the KV cache in GiB, > 0: the K+V page pool; on the offloaded cache, the GPU "
        "buffer, the GPU home pages and the sparse algorithm's index (Select's page summaries) "
        "together. null: what gpu_memory_utilization leaves on CUDA, 2 GiB on the CPU."))
    enable_prefix_caching: StrictBool = Field(True, description=(
        "Paged cache: requests whose leading tokens equal an earlier request's (a chat "
        "template, a system prompt, a repeated prompt) reuse the K/V of its full pages and "
        "prefill from there. Idle cached pages count as free and are evicted least recently used "
        "first. Ignored on the offloaded cache (Spin's cache shares no pages), and off for models "
        "with sliding-window layers (Gemma 3), whose pages behind the window are freed."))
    host_kv_gib: float | None = Field(None, ge=0, description=(
        "Host tier size in GiB (offloaded cache), >= 0; null: 8 GiB; 0: no host tier (every page "
        "on the GPU, which needs gpu_home_fraction > 0). It must fit the memory of the machine that "
        "runs the engine (pinned pages are never swapped out)."))
    host_kv_dtype: Literal["auto", "fp8"] = Field("auto", description=(
        'Offloaded cache: how host pages hold K and V. "auto": the model\'s dtype; "fp8": e4m3 with a '
        "float32 scale per token row, half the host bytes (twice the pages in host_kv_gib) and "
        "half the PCIe bytes of a retrieved page, dequantised on the way to the GPU."))
    kv_cache_dtype: Literal["auto", "float16", "float32"] | None = Field("auto", description=(
        'The paged cache\'s K/V pages (the offloaded cache\'s host pages take host_kv_dtype). '
        '"auto": the model\'s dtype, as vLLM\'s --kv-cache-dtype auto; "float16", '
        '"float32": pages of that type on the CPU (widened to float32 as they are read; on a GPU '
        "only the model's dtype). null (the bundled serving config's choice): float16 on a CPU "
        "whose native decode kernel reads it, when the model runs in float32 -- half the bytes a "
        "decode step reads (a 16-row step of SmolLM2-135M at 580 tokens: 427 against 213 MB), the "
        "scores and sums still in float32 -- else the model's dtype."))
    gpu_home_fraction: float | None = Field(None, ge=0, lt=1, description=(
        "Offloaded cache: the share of the GPU KV memory, in [0, 1), that holds pages at home; the "
        "rest is the buffer's slots, which cache the host pages Select picks. A page is born on the "
        "GPU while there is room and moves to the host, coldest first, only when the GPU is full, so "
        "the cache holds what the GPU and the host hold together. null: the buffer gets the "
        "selected pages of max_num_seqs requests 1.25 times over (at most half the memory), home "
        "pages the rest; 0: the host is every page's home and the GPU a buffer of copies."))
    buffer_share: float = Field(0.0, description=(
        "Offloaded cache: the cap of each (request, layer, KV head)'s GPU buffer share, as a "
        "multiple (>= 1) of the pages a step selects: the columns past 1x keep pages that recent "
        "steps selected (temporal locality). 0: no cap, a share may grow to the request's every "
        "page while the GPU buffer has room, so KV that fits the GPU is kept there whole."))

    @field_validator("page_size")
    @classmethod
    def _page_size(cls, value: int) -> int:
        return _power_of_two(value, 1, 256)

    @field_validator("buffer_share")
    @classmethod
    def _buffer_share(cls, value: float) -> float:
        if not (value >= 1 or value == 0):
            raise ValueError("must be >= 1 (a multiple of the selected pages) or 0 (no cap)")
        return value

    @model_validator(mode="after")
    def _kv_dtype_on_paged_cache(self) -> CacheConfig:
        if self.kind == "offloaded" and self.kv_cache_dtype not in (None, "auto"):
            raise ValueError(f"cache.kv_cache_dtype={self.kv_cache_dtype!r} applies to the paged cache; the "
                             "offloaded cache's host pages take cache.host_kv_dtype")
        return self


class PrefillOptions(ConfigSection):
    """Options every prefill algorithm takes: none (`dense`: every causal key, SDPA)."""


class BlockPrefillOptions(PrefillOptions):
    """`block` prefill: block-sparse attention of prompt chunks (`spin_cluster.sparse.prefill`):
    each (KV head, query block) attends to its sink blocks, its local band, its diagonal block
    and the middle key blocks its budget takes, ranked by an estimate of their attention mass."""

    block_size: int = Field(64, description="Positions per query block and key block, a power of two in 16..128.")
    estimator: Literal["antidiagonal", "pooled", "strided"] = Field("antidiagonal", description=(
        'Key-block importance estimate: "antidiagonal" (XAttention: q.k summed along every '
        'stride-th antidiagonal), "pooled" (block-mean q . block-mean k) or "strided" '
        "(stride-mean q . block-mean k: 1/16 of the antidiagonal estimate's cost or less)."))
    stride: int = Field(8, description=(
        "antidiagonal: positions between sampled antidiagonals; strided: queries per pooled "
        "group. A power of two dividing block_size."))
    sink_blocks: int = Field(1, ge=0, description=(
        "Always-kept first key blocks (attention sinks), >= 0. The diagonal block is always kept."))
    local_blocks: int = Field(1, ge=0, description=(
        "Always-kept key blocks just left of the diagonal (local band), >= 0."))
    budgets: Literal["uniform", "threshold", "per_head"] = Field("uniform", description=(
        'More key blocks per (KV head, query block): "uniform" (budget for every head), '
        '"threshold" (the fewest best blocks whose estimated mass, with the kept ones, reaches '
        'threshold: XAttention), "per_head" (per_head_budgets, or S-HPLB budgets from profile).'))
    budget: float = Field(0.25, gt=0, description=(
        "Middle key blocks per query block: a fraction (0, 1) of its middle blocks, or a count >= 1."))
    threshold: float = Field(0.9, gt=0, le=1, description="threshold: estimated attention mass to reach, (0, 1].")
    per_head_budgets: tuple[tuple[float, ...], ...] | None = Field(None, description=(
        "per_head: [L][Hkv] budgets, each >= 0 with budget's meaning."))
    profile: str | None = Field(None, description=(
        "per_head without per_head_budgets: an S-HPLB head profile (`spin_cluster.hplb`); the "
        "heads' needs at coverage shift the fraction budget between heads (max-min, same total)."))
    coverage: float = Field(0.9, gt=0, le=1, description="The profile's attention mass to cover, (0, 1].")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        return _power_of_two(value, 16, 128)

    @field_validator("per_head_budgets", mode="before")
    @classmethod
    def _rows(cls, rows: Any) -> Any:
        return budget_rows(rows, float)

    @model_validator(mode="after")
    def _fits_together(self) -> BlockPrefillOptions:
        bs, stride = self.block_size, self.stride
        if stride < 1 or stride & (stride - 1) or bs % stride:
            raise ValueError(f"sparse.prefill.options.stride={stride}: use a power of two dividing block_size={bs}")
        check_budget_rows(self.per_head_budgets, "sparse.prefill.options.per_head_budgets")
        if self.budgets == "per_head" and self.per_head_budgets is None and self.profile is None:
            raise ValueError("sparse.prefill.options.budgets='per_head' needs per_head_budgets ([L][Hkv]) or a profile")
        if self.profile is not None and self.budget >= 1:
            raise ValueError(f"sparse.prefill.options.budget={self.budget}: with a profile give the mean as a "
                             "fraction in (0, 1)")
        return self


# The prefill algorithms' options, by name (``sparse.prefill.algorithm``).
PREFILL_OPTIONS: dict[str, type[PrefillOptions]] = {"dense": PrefillOptions, "block": BlockPrefillOptions}


class SparsePrefillConfig(ConfigSection):
    """``sparse.prefill``: block-sparse attention of prompt chunks (``spin_cluster.sparse.prefill``).

    It changes which scores prefill computes, never what it stores: every prompt token's K/V
    is written, so decode (``sparse.algorithm``) and the memory system work unchanged."""

    moved_keys: ClassVar[dict[str, str]] = {name: f"options.{name}" for name in BlockPrefillOptions.model_fields}

    algorithm: Literal["dense", "block"] = Field("dense", description=(
        '"dense": every causal key (SDPA); "block": block-sparse prefill.'))
    options: dict[str, Any] | None = Field(None, description=(
        "The prefill algorithm's own options, typed per algorithm (the tables below), e.g. "
        '{"budget": 0.125, "estimator": "strided"} for block; dense takes none. An option the '
        "algorithm does not take is an error naming it."))

    @model_validator(mode="after")
    def _options_of_the_algorithm(self) -> SparsePrefillConfig:
        self.typed_options()
        return self

    def typed_options(self) -> PrefillOptions:
        """``options`` as the algorithm's model (``BlockPrefillOptions`` for block), defaults filled in."""
        return parse_options(PREFILL_OPTIONS[self.algorithm], self.algorithm, self.options,
                             ("sparse", "prefill", "options"))


DEFAULT_BUDGET_FLOOR_TOKENS = 2048


class SparseConfig(ConfigSection):
    moved_keys: ClassVar[dict[str, str]] = {name: f"options.{name}" for name in ("top_p", "resident_margin",
                                                                                 "per_head_budgets")}

    algorithm: str = Field("dense", description=(
        "Registered algorithm: dense, streaming, ... (`spin_cluster.sparse.registered_algorithms()`; "
        "the serving config checks the name before it starts anything)."))
    budget: float = Field(2048, gt=0, description=(
        "Middle pages' budget per head: tokens if >= 1, else a fraction (0, 1) of the context "
        "(never under budget_floor_tokens); > 0."))
    # Under a few thousand tokens sparse attention saves little and a fraction of the context
    # is too few tokens to keep a needle: Quest and ShadowKV budget 2048 tokens at least.
    budget_floor_tokens: int | None = Field(None, ge=0, description=(
        "The floor of the budget, in tokens, >= 0 (0: off). A request whose context is at or "
        "under it attends densely (every page); above it a fractional budget takes "
        "max(floor, budget x context) tokens per head, while a budget in tokens and "
        "options.per_head_budgets apply as they are (the floor never raises them). null: "
        f"{DEFAULT_BUDGET_FLOOR_TOKENS} with a fractional budget, 0 with a budget in tokens."))
    sink_tokens: int = Field(16, ge=0, description="Always-kept first tokens (attention sinks), >= 0.")
    local_tokens: int = Field(64, ge=0, description="Always-kept last tokens (local window), >= 0.")
    # Quest and ShadowKV leave the first layers, whose attention is the least sparse, dense.
    dense_layers: int = Field(0, ge=0, description=(
        "The first N decoder layers attend densely, >= 0. On the offloaded cache these layers "
        "read the whole context from the host tier each decode step (PCIe traffic of N/L of a "
        "dense offload step); the other layers select. 0: every layer selects."))
    # resident_margin and per_head_budgets moved into options: Select's hysteresis and per-head
    # budgets mean something only where an algorithm scores pages (the algorithms that take top_p).
    options: dict[str, Any] | None = Field(None, description=(
        "The algorithm's own options, typed per algorithm (the tables below), e.g. "
        '{"summary": "moments"} for quest, {"index_dtype": "float8_e4m3fn"} for labels, '
        '{"top_p": 0.9, "resident_margin": 0.5, "per_head_budgets": [[...]]} for an algorithm that '
        "scores pages; an option the algorithm does not take is an error naming it."))
    prefill: SparsePrefillConfig = Field(default_factory=SparsePrefillConfig, description=(
        "Block-sparse prefill; default: dense."))

    @field_validator("prefill", mode="before")
    @classmethod
    def _prefill(cls, value: Any) -> Any:
        return {} if value is None else value

    @model_validator(mode="after")
    def _options_of_the_algorithm(self) -> SparseConfig:
        # An algorithm outside the table is checked once its class, and its model, are known.
        if self.algorithm in OPTIONS:
            self.typed_options()
        return self

    def typed_options(self, model: type[BaseModel] | None = None) -> Any:
        """``options`` as the algorithm's model (``model``, else the table's:
        ``spin_cluster.algorithm_options``), defaults filled in."""
        return parse_options(model or OPTIONS[self.algorithm], self.algorithm, self.options, ("sparse", "options"))

    @property
    def top_p(self) -> float | None:
        """Select's top-p mass (``options.top_p``, an option of the algorithms that score
        pages); None: top-k."""
        top_p = (self.options or {}).get("top_p")
        return None if top_p is None else float(top_p)

    @property
    def resident_margin(self) -> float:
        """Select's hysteresis in nats (``options.resident_margin``, an option of the algorithms
        that score pages); 0: off."""
        return float((self.options or {}).get("resident_margin", 0.0))

    @property
    def per_head_budgets(self) -> tuple[tuple[int, ...], ...] | None:
        """[L][Hkv] middle budgets in whole tokens (``options.per_head_budgets``, an option of the
        algorithms that score pages); None: ``budget`` for every head."""
        rows = (self.options or {}).get("per_head_budgets")
        return None if rows is None else budget_rows(rows, int)


class SchedulerConfig(ConfigSection):
    retired_keys: ClassVar[dict[str, str]] = {
        "max_prefill_tokens": "scheduler.max_prefill_tokens is no longer a setting: prompt chunks take what "
                              "scheduler.max_num_batched_tokens leaves after the decode tokens (every measured "
                              "run did); remove it",
        "admission_output_tokens": "scheduler.admission_output_tokens is no longer a setting: admission keeps room "
                                   "for 2048 output tokens of each running request beside the prompts (a test or "
                                   "benchmark that must force preemptions passes Engine(admission_output_tokens=0)); "
                                   "remove it",
    }

    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most requests running at once (decode batch size), 1..4096.")
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "Most tokens (prefill chunks + decode tokens) in one step, >= 1."))
    # max_prefill_tokens is no setting: no measurement bounded prompt tokens below the step's budget.
    # admission_output_tokens neither: only tests that force preemptions moved it (a code-level
    # Engine keyword now, spin_cluster.engine.scheduler.ADMISSION_OUTPUT_TOKENS by default).
    enable_chunked_prefill: StrictBool = Field(True, description=(
        "Split long prompts into chunks of at most the step's leftover token budget. When off, a "
        "prompt is prefilled in one step, so max_num_batched_tokens must cover max_model_len."))
    async_decode: StrictBool | None = Field(None, description=(
        "Pipelined decode: while the GPU runs decode step n+1, the host reads step n's tokens and "
        "does its bookkeeping (decode-only batches, greedy or sampled, without a grammar or a "
        "min_tokens ban left: the tokens are sampled on the GPU and go to the next step without "
        "the host). null: on with CUDA, off on CPU."))


class SpinConfig(ConfigSection):
    model: ModelOptions = Field(default_factory=ModelOptions, description="The checkpoint and how to run it.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="The KV cache: pages, tiers, buffer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Batching of requests.")
    sparse: SparseConfig = Field(default_factory=SparseConfig, description="Sparse attention of decode and prefill.")

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        """A YAML section written with no keys (``cache:``) is the section's defaults."""
        if isinstance(data, dict):
            return {k: {} if v is None else v for k, v in data.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SpinConfig:
        return parse_config(cls, data or {})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def context_len(self, mc: ModelConfig) -> int:
        """The longest context this config serves on ``mc``: ``model.max_model_len``, else the
        model's own (as vLLM's ``max_model_len`` defaults)."""
        return self.model.max_model_len or mc.context_len

    def check_model(self, mc: ModelConfig) -> None:
        """Raises ``ValueError`` where this config does not fit the model ``mc`` (its
        ``config.json``): the context, the prefill token budget, per-head budget shapes, the
        dense layers of the offloaded cache. Cheap (no weights), so a server checks it before it starts anything."""
        context = self.context_len(mc)
        if context > mc.context_len:
            yarn = "" if mc.rope_scaling else (" (a longer context needs RoPE scaling: see model.hf_overrides, "
                                               "e.g. YaRN for Qwen2.5)")
            raise ValueError(
                f"model.max_model_len={context} exceeds the model's context of {mc.context_len} tokens{yarn}: "
                f"lower it, or leave it null for {mc.context_len}"
            )
        sc = self.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < context:
            raise ValueError(
                f"without chunked prefill, scheduler.max_num_batched_tokens ({sc.max_num_batched_tokens}) "
                f"must be >= max_model_len ({context})"
            )
        prefill_rows = getattr(self.sparse.prefill.typed_options(), "per_head_budgets", None)
        for name, rows in (("sparse.options.per_head_budgets", self.sparse.per_head_budgets),
                           ("sparse.prefill.options.per_head_budgets", prefill_rows)):
            if rows is not None and (len(rows) != mc.num_layers or any(len(r) != mc.num_kv_heads for r in rows)):
                raise ValueError(f"{name} must be [{mc.num_layers}][{mc.num_kv_heads}] (layers x KV heads) "
                                 "for this model")
        if self.cache.kind == "offloaded" and self.sparse.dense_layers > mc.num_layers:
            raise ValueError(f"sparse.dense_layers={self.sparse.dense_layers}: the model has {mc.num_layers} layers")

    def head_parallel_refusal(self) -> str | None:
        """Why head-parallel ranks (``spin_cluster.parallel``) cannot run this config, or None.

        They run the GPU-only paged cache and the offloaded Spin cache with any Select that
        scores each KV head on its own, and dense prefill; the engine refuses the rest with
        this message, and the serving config checks it before any engine starts."""
        if self.cache.kind == "offloaded" and self.sparse.algorithm == "seer":
            return ("head-parallel ranks cannot run seer for now (its gate holds weights per layer and KV head "
                    "of the whole model): use another sparse.algorithm")
        if self.cache.kind == "offloaded" and self.sparse.top_p is not None:
            return ("head-parallel ranks cannot run top-p Select (a layer's heads share one budget across ranks): "
                    "leave sparse.options.top_p out")
        if self.sparse.prefill.algorithm != "dense":
            return "head-parallel ranks support dense prefill only for now: set sparse.prefill.algorithm=dense"
        return None

    def replace(self, **sections: Any) -> SpinConfig:
        """Copy with some sections' fields replaced, validated: ``cfg.replace(model={"path": p})``."""
        changed = {name: {**section.model_dump(), **sections[name]} for name, section in self if name in sections}
        return parse_config(type(self), {**self.to_dict(), **sections, **changed})  # an unknown name: refused
