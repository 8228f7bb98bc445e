"""Accuracy of sparse attention on the synthetic tasks, measured through the engine.

    prompts   task x length x sample, each built once (``ruler.make_sample``)
    methods   dense (the reference), then each algorithm at each budget (``methods.py``)
    run       per method one Engine, all prompts in one batch, greedy decoding
    score     RULER's string match per output; accuracy = mean over samples

A prompt fills ``length - max_tokens`` tokens so that prompt and answer fit ``length``
(RULER's rule), and the engines' ``max_model_len`` is the longest length. Prefill attends
densely, except in the sparse-prefill methods (``prefill_modes``), which run one engine per
length so that each length's computed share of key blocks (``prefill_density``) is reported;
their threshold and S-HPLB budgets are calibrated once, on an unscored prompt of the first
task at the longest length, to compute as many blocks as uniform.

A task the model fails densely (dense accuracy below ``dense_threshold`` at that length)
says nothing about sparse attention: its row is marked and left out of the averages.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spin_cluster.config import SpinConfig
from spin_cluster.profiling import ruler
from spin_cluster.profiling.methods import WINDOW_ONLY, Method, budget_mode_options, make_methods


@dataclass(frozen=True)
class EvalConfig:
    # Model folder; None: the default model (SmolLM2-135M-Instruct).
    model_path: str | None = None
    # Task names (``ruler.task_names()``).
    tasks: tuple[str, ...] = tuple(ruler.task_names())
    # Context lengths in tokens, prompt + answer; each <= the model's context.
    lengths: tuple[int, ...] = (2048, 4096, 8192)
    # Samples per (task, length), >= 1.
    samples_per_task: int = 5
    # Registered sparse algorithms; dense always runs as the reference.
    algorithms: tuple[str, ...] = ("dense", "streaming", "quest")
    # Bundled serving configs by name (``deployments/configs``: spin, spin-quest, spin-fast) or
    # YAML paths, each run with its own sparse section, page size and host dtype.
    configs: tuple[str, ...] = ()
    # model.hf_overrides of every engine (e.g. YaRN's rope_scaling past a 32K context).
    hf_overrides: dict | None = None
    # Middle tokens per head: fractions (0, 1) of the context, or token counts >= 1.
    budgets: tuple[float, ...] = (0.125, 0.0625, 0.03125)
    # Block-sparse prefill budget modes (uniform, threshold, hplb) run with dense decode, at the
    # key blocks of uniform prefill_budget (a fraction (0, 1) of each query block's middle
    # blocks), in blocks of prefill_block_size positions.
    prefill_modes: tuple[str, ...] = ()
    prefill_budget: float = 0.25
    prefill_block_size: int = 64
    # Their key-block estimate (``sparse.prefill.options.estimator``) and its stride.
    prefill_estimator: str = "antidiagonal"
    prefill_stride: int = 8
    # How scored algorithms spread each budget over heads (``methods.BUDGET_MODES``): uniform
    # top-k, online top-p at mass top_p (0, 1], or S-HPLB max-min per-head budgets from the head
    # profile at profile_path (``spin-cluster profile``) with floors of floor_fraction (0..1)
    # of the uniform budget. All at the same total.
    budget_modes: tuple[str, ...] = ("uniform",)
    top_p: float = 0.9
    profile_path: str | None = None
    floor_fraction: float = 0.25
    # sparse.budget_floor_tokens of every sparse method, >= 0: a context at or under it runs
    # dense, a fractional budget takes this many tokens at least. 0 (off): each Select is
    # measured at its own budget; 2048: as the bundled `spin` config runs.
    budget_floor_tokens: int = 0
    # Always-kept first / last tokens of every sparse method, >= 0.
    sink_tokens: int = 16
    local_tokens: int = 64
    # sparse.dense_layers of every sparse method: its first N layers attend densely.
    dense_layers: int = 0
    # Greedy tokens generated per prompt, >= 1.
    max_tokens: int = 48
    # Requests running at once per engine (the rest queue), >= 1. Host/GPU KV is sized for it.
    max_batch: int = 8
    # Tokens per engine step (scheduler.max_num_batched_tokens), >= 1: prompts are prefilled in
    # chunks of this size. Each step has a fixed host cost, so larger chunks finish sooner.
    max_batched_tokens: int = 8192
    # model.device and model.dtype of the engines ("auto": cuda + bf16 if available).
    device: str = "auto"
    dtype: str = "auto"
    # Tokens per KV page, as cache.page_size.
    page_size: int = 16
    # sparse.options of every sparse method on the offloaded cache (e.g. Quest's
    # score_block_tokens); an option the algorithm does not take fails its engine.
    algorithm_options: dict = dataclasses.field(default_factory=dict)
    # cache.buffer_share of the offloaded methods (>= 1): each (request, layer, KV head)'s GPU
    # buffer share as a multiple of the pages a step selects.
    buffer_share: float = 2.0
    # sparse.options.resident_margin of the offloaded methods that score pages (nats, >= 0; 0: off).
    resident_margin: float = 0.0
    # cache.host_kv_dtype of the offloaded methods: "auto" (the model's dtype) or "fp8" (e4m3
    # with a scale per token row). Every page of those methods lives on the host (see
    # spin_config), so every page they read went through it.
    host_kv_dtype: str = "auto"
    # model.cuda_graphs off (vLLM's --enforce-eager): every decode step runs eagerly, e.g. to
    # tell a graph's effect on tokens from the method's.
    enforce_eager: bool = False
    # Dense accuracy below this (0..1) marks a task as failed densely at that length.
    dense_threshold: float = 0.2
    # Samples are seeds seed, seed + 1, ...
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tasks", "lengths", "algorithms", "budgets", "prefill_modes", "budget_modes", "configs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for task in self.tasks:
            ruler.get_task(task)
        if not self.tasks or not self.lengths:
            raise ValueError("give at least one task and one length")
        if self.samples_per_task < 1:
            raise ValueError(f"samples_per_task={self.samples_per_task}: must be >= 1")
        if self.max_tokens < 1 or self.max_batch < 1 or self.max_batched_tokens < 1:
            raise ValueError("max_tokens, max_batch and max_batched_tokens must be >= 1")
        if min(self.lengths) <= self.max_tokens:
            raise ValueError(
                f"lengths must exceed max_tokens ({self.max_tokens}): the prompt fills length - max_tokens"
            )
        if not (self.buffer_share >= 1 or self.buffer_share == 0):
            raise ValueError(f"buffer_share={self.buffer_share}: must be >= 1, or 0 for no cap")
        if self.host_kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"host_kv_dtype={self.host_kv_dtype!r}: use auto or fp8")
        if not self.resident_margin >= 0:
            raise ValueError(f"resident_margin={self.resident_margin}: must be >= 0")
        if not 0 <= self.dense_threshold <= 1:
            raise ValueError(f"dense_threshold={self.dense_threshold}: use 0..1")
        if min(self.sink_tokens, self.local_tokens, self.dense_layers, self.budget_floor_tokens) < 0:
            raise ValueError("sink_tokens, local_tokens, dense_layers and budget_floor_tokens must be >= 0")
        if not 0 < self.top_p <= 1 or not 0 <= self.floor_fraction <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] and floor_fraction={self.floor_fraction} in 0..1")
        if "maxmin" in self.budget_modes and not self.profile_path:
            raise ValueError("budget mode maxmin needs a head profile: make one with "
                             "`spin-cluster profile --out F` and pass --profile F")
        self.methods()  # unknown algorithms and bad budgets fail here, before any model loads

    def methods(self) -> list[Method]:
        return make_methods(self.algorithms, self.budgets, self.prefill_modes, self.prefill_budget,
                            self.budget_modes, self.configs)

    def resolved_model_path(self) -> str:
        if self.model_path:
            return self.model_path
        from spin_cluster.model_store import prepare_default_model

        return str(prepare_default_model())


@dataclass(frozen=True)
class SampleResult:
    task: str
    length: int  # the context length asked for (prompt + answer)
    seed: int
    num_prompt_tokens: int
    method: str  # Method.label
    answers: tuple[str, ...]
    output: str
    score: float  # 0..1


@dataclass
class EvalResults:
    config: EvalConfig
    methods: list[Method]
    samples: list[SampleResult]
    elapsed_s: float = 0.0
    fidelity: list = field(default_factory=list)  # fidelity.FidelityRow, when measured
    # "label@length" -> computed / causal key blocks of a sparse-prefill method's prefills.
    prefill_density: dict[str, float] = field(default_factory=dict)
    # "label@length" -> Retrieve's page lookups in the GPU buffer of an offloaded method's
    # engine: {"hits": n, "misses": n} (the real-pattern buffer hit ratio).
    buffer_lookups: dict[str, dict[str, int]] = field(default_factory=dict)
    # Method.label -> wall seconds of its engines (build, warm-up and every prompt): where a
    # run's time goes, to size the next one.
    method_s: dict[str, float] = field(default_factory=dict)

    def buffer_hit_ratio(self, key: str) -> float | None:
        looked = self.buffer_lookups.get(key)
        total = looked and looked["hits"] + looked["misses"]
        return looked["hits"] / total if total else None

    def accuracy(self, task: str, length: int, method: str) -> float:
        scores = [s.score for s in self.samples if (s.task, s.length, s.method) == (task, length, method)]
        if not scores:
            raise KeyError(f"no samples of {task!r} at {length} for {method!r}")
        return sum(scores) / len(scores)

    def dense_failures(self, length: int) -> list[str]:
        """Tasks whose dense accuracy at ``length`` is below the threshold."""
        return [t for t in self.config.tasks if self.accuracy(t, length, "dense") < self.config.dense_threshold]

    def average(self, length: int, method: str) -> float | None:
        """Mean accuracy over the tasks not failed densely; None if every task failed."""
        kept = [t for t in self.config.tasks if t not in self.dense_failures(length)]
        return sum(self.accuracy(t, length, method) for t in kept) / len(kept) if kept else None

    def to_dict(self) -> dict:
        c = self.config
        return {
            "config": dataclasses.asdict(c),
            "methods": [{"label": m.label, "algorithm": m.algorithm, "budget": m.budget, "budget_mode": m.budget_mode}
                        for m in self.methods],
            "elapsed_s": self.elapsed_s,
            "method_s": self.method_s,
            "accuracy": {
                str(n): {
                    m.label: {t: self.accuracy(t, n, m.label) for t in c.tasks} | {"average": self.average(n, m.label)}
                    for m in self.methods
                }
                for n in c.lengths
            },
            "dense_failures": {str(n): self.dense_failures(n) for n in c.lengths},
            "samples": [dataclasses.asdict(s) for s in self.samples],
            "fidelity": [dataclasses.asdict(r) for r in self.fidelity],
            "prefill_density": self.prefill_density,
            "buffer_lookups": self.buffer_lookups,
            "buffer_hit_ratio": {k: self.buffer_hit_ratio(k) for k in self.buffer_lookups},
        }


EngineFactory = Callable[[SpinConfig], object]


def build_samples(config: EvalConfig, tokenizer) -> list[tuple[int, ruler.Sample]]:
    """(length, sample) for every task x length x seed, the prompts every method gets."""
    return [
        (n, ruler.make_sample(task, tokenizer, n - config.max_tokens, config.seed + i))
        for n in config.lengths for task in config.tasks for i in range(config.samples_per_task)
    ]


def evaluate(config: EvalConfig, *, engine_factory: EngineFactory | None = None, progress: bool = True,
             checkpoint: Callable[[EvalResults], None] | None = None) -> EvalResults:
    """Run every method on every prompt. ``engine_factory(SpinConfig) -> Engine`` builds the
    engines (default: ``Engine(config, progress=False)``), one per method (one per method and
    length for window-only methods at fractional budgets, whose window depends on it).
    ``checkpoint(results so far)`` after each method, so that a long run cut short (a GPU
    lease's limit) keeps the methods it finished."""
    from tqdm.auto import tqdm

    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.tokenizer import Tokenizer

    t0 = time.perf_counter()
    methods = config.methods()
    path = config.resolved_model_path()
    factory = engine_factory or (lambda cfg: Engine(cfg, progress=False))
    work = build_samples(config, Tokenizer(path))
    params = SamplingParams(temperature=0, max_tokens=config.max_tokens)
    calibration = _calibrate_prefill(config, path) if any(m.prefill for m in methods) else None
    results: list[SampleResult] = []
    density: dict[str, float] = {}
    lookups: dict[str, dict[str, int]] = {}
    seconds: dict[str, float] = {}
    with tqdm(total=len(methods) * len(work), unit="prompt", disable=not progress) as bar:
        for done, method in enumerate(methods, start=1):
            bar.set_description(method.label)
            started = time.perf_counter()
            for lengths in _engine_groups(method, config.lengths):
                batch = [(n, s) for n, s in work if n in lengths]
                engine = factory(spin_config(config, path, method, max(lengths), calibration))
                texts = _generate(engine, [list(s.prompt_ids) for _, s in batch], params, bar)
                if method.sparse_prefill:
                    density[f"{method.label}@{lengths[0]}"] = engine.runner.attention.sparse_prefill.density()
                st = getattr(engine, "last_stats", None)
                if method.offloaded and st is not None:
                    lookups[f"{method.label}@{'+'.join(map(str, lengths))}"] = {
                        "hits": st.buffer_hits_total, "misses": st.buffer_misses_total}
                del engine
                gc.collect()  # the next engine's cache goes where this one's was
                results.extend(
                    SampleResult(s.task, n, s.seed, s.num_tokens, method.label, s.answers, text, s.score(text))
                    for (n, s), text in zip(batch, texts)
                )
            seconds[method.label] = time.perf_counter() - started
            if checkpoint is not None:
                checkpoint(EvalResults(config, methods[:done], list(results), time.perf_counter() - t0, prefill_density=density,
                                       buffer_lookups=lookups, method_s=dict(seconds)))
    return EvalResults(config, methods, results, time.perf_counter() - t0, prefill_density=density,
                       buffer_lookups=lookups, method_s=seconds)


def _engine_groups(method: Method, lengths: Sequence[int]) -> list[tuple[int, ...]]:
    return [(n,) for n in lengths] if method.depends_on_length() or method.sparse_prefill else [tuple(lengths)]


def _calibrate_prefill(config: EvalConfig, model_path: str) -> dict:
    """length -> ``sparse.prefill.calibrate`` on an unscored prompt of that length (the seed
    after the samples). Per length: a threshold set at one length computes a different share
    of the blocks at another (attention spreads differently), and the modes are compared at
    equal block counts."""
    from spin_cluster.config import BlockPrefillOptions
    from spin_cluster.engine.engine import resolve_device, resolve_dtype
    from spin_cluster.models import load_model
    from spin_cluster.sparse.prefill import calibrate
    from spin_cluster.tokenizer import Tokenizer

    device = resolve_device(config.device)
    model = load_model(model_path, dtype=resolve_dtype(config.dtype, device), device=device, progress=False,
                       overrides=config.hf_overrides).eval()
    prefill = BlockPrefillOptions(block_size=config.prefill_block_size, budget=config.prefill_budget,
                                  estimator=config.prefill_estimator, stride=config.prefill_stride)
    tokenizer = Tokenizer(model_path)
    out = {}
    for n in config.lengths:
        sample = ruler.make_sample(config.tasks[0], tokenizer, n - config.max_tokens, config.seed + config.samples_per_task)
        out[n] = calibrate(model, sample.prompt_ids, prefill)
    return out


def _prefill_options(config: EvalConfig, method: Method, calibration) -> dict:
    """The ``sparse.prefill`` section of a sparse-prefill method (``calibrate``'s budgets)."""
    options = {"block_size": config.prefill_block_size, "budget": method.prefill_budget,
               "estimator": config.prefill_estimator, "stride": config.prefill_stride}
    if method.prefill == "threshold":
        options.update(budgets="threshold", threshold=calibration.threshold)
    if method.prefill == "hplb":
        options.update(budgets="per_head", per_head_budgets=calibration.per_head_budgets)
    return {"algorithm": "block", "options": options}


def _generate(engine, prompts: list[list[int]], params, bar) -> list[str]:
    """``engine.generate`` with the progress bar advanced as each request finishes."""
    ids = [engine.add_request(p, params) for p in prompts]
    texts: dict[str, str] = {}
    while len(texts) < len(ids):
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.text
                bar.update(1)
    return [texts[i] for i in ids]


def spin_config(config: EvalConfig, model_path: str, method: Method, length: int, calibration=None) -> SpinConfig:
    """The engine config of ``method`` for prompts of up to ``length`` tokens (with answer);
    ``calibration`` (length -> ``sparse.prefill.PrefillCalibration``) for sparse-prefill methods."""
    sparse = method.sparse_options(length, config.sink_tokens, config.local_tokens, config.budget_floor_tokens)
    if method.config is not None:
        return _bundled_config(config, model_path, method, sparse)
    if method.offloaded and config.dense_layers:
        sparse["dense_layers"] = config.dense_layers
    if method.offloaded and not method.is_dense and config.algorithm_options:
        sparse["options"] = dict(config.algorithm_options)
    if method.offloaded and not method.is_dense and config.resident_margin and method.algorithm not in WINDOW_ONLY:
        sparse["options"] = {**sparse.get("options", {}), "resident_margin": config.resident_margin}
    if method.prefill:
        sparse["prefill"] = _prefill_options(config, method, calibration and calibration[length])
    profile, layers = None, None
    if method.budget_mode == "maxmin":
        profile, layers = _head_profile(config.profile_path, model_path)
    spread = budget_mode_options(method, length, page_size=config.page_size, top_p=config.top_p, profile=profile,
                                 floor_fraction=config.floor_fraction, floor_tokens=config.budget_floor_tokens,
                                 sparse_layers=layers)
    if "options" in spread:  # top_p, beside the algorithm's own options
        spread["options"] = {**(sparse.get("options") or {}), **spread["options"]}
    sparse.update(spread)
    cache = {"page_size": config.page_size, "kind": "offloaded" if method.offloaded else "paged",
             "buffer_share": config.buffer_share}
    if method.offloaded:
        cache["host_kv_dtype"] = config.host_kv_dtype
    return _engine_config(config, model_path, cache, sparse)


def _bundled_config(config: EvalConfig, model_path: str, method: Method, sparse: dict) -> SpinConfig:
    """A bundled config's sparse section and page settings, at the eval's sizes."""
    cache = {"page_size": config.page_size, **method.bundled_sections()["cache"], "buffer_share": config.buffer_share}
    return _engine_config(config, model_path, cache, sparse)


def _engine_config(config: EvalConfig, model_path: str, cache: dict, sparse: dict) -> SpinConfig:
    max_len = max(config.lengths)
    if cache.get("kind") == "offloaded":
        # The sizes below give the buffer the whole GPU budget and the host every page, as the
        # published runs had it: the hit ratio the table reports is the buffer's. Where a page
        # lives does not change what attention computes unless host_kv_dtype is fp8, and then
        # every page read went through the host's FP8 (the worst case for its accuracy).
        cache["gpu_home_fraction"] = 0.0
    cache.update(_cache_sizes(config, model_path, max_len, cache["page_size"]))
    return SpinConfig.from_dict({
        "model": {"path": model_path, "device": config.device, "dtype": config.dtype, "max_model_len": max_len,
                  "cuda_graphs": not config.enforce_eager, "hf_overrides": config.hf_overrides},
        "cache": cache,
        "scheduler": {"max_num_seqs": config.max_batch, "max_num_batched_tokens": config.max_batched_tokens},
        "sparse": sparse,
    })


@functools.lru_cache(maxsize=2)
def _head_profile(profile_path: str, model_path: str):
    """(the head profile, checked against the model; the layers Select serves), read once."""
    from spin_cluster.hplb.profile import load_profile
    from spin_cluster.models.config import ModelConfig

    return load_profile(profile_path, model_path=model_path), ModelConfig.from_folder(model_path).full_attention_layers()


def _cache_sizes(config: EvalConfig, model_path: str, max_len: int, page_size: int) -> dict:
    """GPU pages (or buffer) and host tier for ``max_batch`` requests of ``max_len`` tokens,
    instead of the engine's machine-wide defaults."""
    from spin_cluster.engine.engine import resolve_device, resolve_dtype
    from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY
    from spin_cluster.kvcache.host_tier import HostTier
    from spin_cluster.kvcache.page_pool import PagePool
    from spin_cluster.models.config import ModelConfig

    mc = ModelConfig.from_folder(model_path, config.hf_overrides)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    columns = mc.num_layers * mc.num_kv_heads  # pages of one token position
    S, E = page_size, DEFAULT_POLICY.segment_pages
    pages = -(-max_len // S)
    gpu_bytes = config.max_batch * pages * columns * PagePool.bytes_per_page(S, mc.head_dim, dtype)
    host_bytes = config.max_batch * -(-pages // E) * columns * HostTier.bytes_per_segment(E, S, mc.head_dim, dtype)
    return {"kv_cache_gib": gpu_bytes / 2**30, "host_kv_gib": host_bytes / 2**30}
