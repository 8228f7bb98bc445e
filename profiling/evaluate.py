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

Each method's engine config is ``EvalConfig.base`` (a SpinConfig: the model, cache and
scheduler settings) with the method's sparse section and cache kind, and KV sizes that hold
every page of a full batch (``spin_config``).

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
from typing import Any

from spin_cluster.algorithm_options import SELECT_OPTIONS
from spin_cluster.config import SparseConfig, SpinConfig, parse_config
from spin_cluster.profiling import bundled, ruler
from spin_cluster.profiling.methods import WINDOW_ONLY, Method, budget_mode_options, make_methods

# The eval's engine settings where they are not SpinConfig's defaults: up to 8 requests at once
# per engine (its KV is sized for them); prompts prefilled in chunks of 8192 tokens (each step
# has a fixed host cost, so larger chunks finish sooner); the offloaded methods' GPU buffer
# share twice the pages a step selects; no budget floor, so that each Select is measured at its
# own budget (2048: as the bundled `spin` config runs).
EVAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 8192},
    "cache": {"buffer_share": 2.0},
    "sparse": {"budget_floor_tokens": 0},
}


def base_config(base: SpinConfig | dict | str | None = None) -> SpinConfig:
    """``EvalConfig.base`` as a SpinConfig: a SpinConfig as it is; else ``EVAL_DEFAULTS`` with
    ``base``'s sections laid over them key by key: a dict of sections, or a bundled config's
    name or a YAML path (``spin-cluster serve --config``'s engine sections). A bad value is a
    ValueError naming its field (``SpinConfig.from_dict``)."""
    if isinstance(base, SpinConfig):
        return base
    sections = bundled.engine_sections(base) if isinstance(base, str) else dict(base or {})
    return SpinConfig.from_dict(EVAL_DEFAULTS).replace(**{k: v or {} for k, v in sections.items()})


@dataclass(frozen=True)
class EvalConfig:
    """A sweep (tasks x lengths x methods) over engines built from ``base``."""

    # The engine settings every method starts from (``base_config``: a SpinConfig, or a dict of
    # its sections, a bundled config's name or a YAML path, over EVAL_DEFAULTS): the model
    # (path, device, dtype, hf_overrides, cuda_graphs), the cache's page size and buffer_share,
    # the scheduler's batch sizes, and of the sparse section what the sparse methods share
    # (sink_tokens, local_tokens, budget_floor_tokens; dense_layers on the offloaded cache).
    # Each method brings its own sparse section (the base's algorithm, budget and options are
    # its own method's) and cache kind; the offloaded ones take cache.host_kv_dtype. Sizes are
    # the eval's: model.max_model_len is the longest length, and the KV tiers hold every page
    # of scheduler.max_num_seqs requests of it (``_cache_sizes``).
    base: SpinConfig | dict | str | None = None
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
    # Middle tokens per head: fractions (0, 1) of the context, or token counts >= 1.
    budgets: tuple[float, ...] = (0.125, 0.0625, 0.03125)
    # sparse.options of every sparse method on the offloaded cache (e.g. Quest's
    # score_block_tokens, resident_margin), each checked against its method's algorithm; Select's
    # (top_p, resident_margin) only where the algorithm scores pages. Not the base's: a
    # SpinConfig's options are its one algorithm's, and a sweep runs several.
    algorithm_options: dict = dataclasses.field(default_factory=dict)
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
    # Greedy tokens generated per prompt, >= 1.
    max_tokens: int = 48
    # Dense accuracy below this (0..1) marks a task as failed densely at that length.
    dense_threshold: float = 0.2
    # Samples are seeds seed, seed + 1, ...
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tasks", "lengths", "algorithms", "budgets", "prefill_modes", "budget_modes", "configs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "base", base_config(self.base))
        for task in self.tasks:
            ruler.get_task(task)
        if not self.tasks or not self.lengths:
            raise ValueError("give at least one task and one length")
        if self.samples_per_task < 1:
            raise ValueError(f"samples_per_task={self.samples_per_task}: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if min(self.lengths) <= self.max_tokens:
            raise ValueError(
                f"lengths must exceed max_tokens ({self.max_tokens}): the prompt fills length - max_tokens"
            )
        if not 0 <= self.dense_threshold <= 1:
            raise ValueError(f"dense_threshold={self.dense_threshold}: use 0..1")
        if not 0 < self.top_p <= 1 or not 0 <= self.floor_fraction <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] and floor_fraction={self.floor_fraction} in 0..1")
        if "maxmin" in self.budget_modes and not self.profile_path:
            raise ValueError("budget mode maxmin needs a head profile: make one with "
                             "`spin-cluster profile --out F` and pass --profile F")
        # Unknown algorithms, bad budgets and each method's engine config (its options, its
        # prefill's, its cache kind beside the base's cache) fail here, before any model loads;
        # a calibrated prefill mode differs from uniform's only in its budgets, a max-min spread
        # is checked against its profile and the sizes against the model when the engine is built.
        for method in self.methods():
            checked = dataclasses.replace(method, prefill="uniform") if method.prefill else method
            _method_config(self, checked, _sparse_section(self, checked, max(self.lengths)))

    def methods(self) -> list[Method]:
        return make_methods(self.algorithms, self.budgets, self.prefill_modes, self.prefill_budget,
                            self.budget_modes, self.configs)

    def resolved_model_path(self) -> str:
        if self.base.model.path:
            return self.base.model.path
        from spin_cluster.model_store import prepare_default_model

        return str(prepare_default_model())

    def to_dict(self) -> dict:
        """The sweep's fields, and the base config's sections under "base"."""
        sweep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "base"}
        return {**sweep, "base": self.base.to_dict()}


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
            "config": c.to_dict(),
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
    from spin_cluster.engine.device import resolve_device, resolve_dtype
    from spin_cluster.models import load_model
    from spin_cluster.sparse.prefill import calibrate
    from spin_cluster.tokenizer import Tokenizer

    mo = config.base.model
    device = resolve_device(mo.device)
    model = load_model(model_path, dtype=resolve_dtype(mo.dtype, device), device=device, progress=False,
                       overrides=mo.hf_overrides).eval()
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
    """The engine config of ``method`` for prompts of up to ``length`` tokens (with answer):
    ``config.base`` with the model at ``model_path`` (``config.resolved_model_path()``), the
    method's cache kind and sparse section, and the KV sizes of the eval (``_cache_sizes``);
    ``calibration`` (length -> ``sparse.prefill.PrefillCalibration``) for sparse-prefill methods."""
    from spin_cluster.sparse.budget import floor_tokens

    sparse = _sparse_section(config, method, length, calibration and calibration[length])
    profile, layers = None, None
    if method.budget_mode == "maxmin":
        profile, layers = _head_profile(config.profile_path, model_path)
    spread = budget_mode_options(method, length, page_size=config.base.cache.page_size, top_p=config.top_p,
                                 profile=profile, floor_fraction=config.floor_fraction,
                                 floor_tokens=floor_tokens(parse_config(SparseConfig, sparse, ("sparse",))),
                                 sparse_layers=layers)
    if "options" in spread:  # top_p, beside the algorithm's own options
        spread["options"] = {**(sparse.get("options") or {}), **spread["options"]}
    sparse.update(spread)
    engine = _method_config(config, method, sparse, model={"path": model_path, "max_model_len": max(config.lengths)})
    return engine.replace(cache=_cache_sizes(engine))


def _method_config(config: EvalConfig, method: Method, sparse: dict, **sections: dict) -> SpinConfig:
    """``config.base`` with ``method``'s cache keys (``_cache_section``) and ``sections``' keys
    laid over its own, and ``sparse`` as its sparse section: whole, since a method's algorithm,
    budget and options are its own, not the base's (SparseConfig's defaults where it says nothing)."""
    engine = config.base.replace(cache=_cache_section(method), **sections)
    return SpinConfig.from_dict({**engine.to_dict(), "sparse": sparse})


def _sparse_section(config: EvalConfig, method: Method, length: int, calibration=None) -> dict:
    """``method``'s sparse section at ``length``, before its budget mode spreads the budget: a
    bundled config's own; else the method's with the base's sink and local tokens and budget
    floor, on the offloaded cache its dense_layers and ``config.algorithm_options``;
    ``calibration`` (the length's) for a calibrated prefill mode."""
    base = config.base.sparse
    sparse = method.sparse_options(length, base.sink_tokens, base.local_tokens, base.budget_floor_tokens)
    if method.config is not None:
        return sparse
    if method.offloaded and base.dense_layers:
        sparse["dense_layers"] = base.dense_layers
    options = config.algorithm_options
    if method.algorithm in WINDOW_ONLY:  # Select's own options apply where it scores pages
        options = {k: v for k, v in options.items() if k not in SELECT_OPTIONS}
    if method.offloaded and not method.is_dense and options:
        sparse["options"] = dict(options)
    if method.prefill:
        sparse["prefill"] = _prefill_options(config, method, calibration)
    return sparse


def _cache_section(method: Method) -> dict:
    """``method``'s cache keys over the base's: a bundled config's own (``bundled.CACHE_KEYS``);
    else its kind, the base's page size, and the base's host dtype where there is a host tier
    (offloaded). An offloaded method's pages all live on the host: the buffer gets the whole GPU
    budget and the host every page, as the published runs had it, so the hit ratio the table
    reports is the buffer's. Where a page lives does not change what attention computes unless
    host_kv_dtype is fp8, and then every page read went through the host's FP8 (the worst case
    for its accuracy)."""
    if method.config is not None:
        cache = dict(method.bundled_sections()["cache"])
    else:  # the paged cache has no host tier: its host dtype stays the default
        cache = {"kind": "offloaded"} if method.offloaded else {"kind": "paged", "host_kv_dtype": "auto"}
    if cache["kind"] == "offloaded":
        cache["gpu_home_fraction"] = 0.0
    return cache


@functools.lru_cache(maxsize=2)
def _head_profile(profile_path: str, model_path: str):
    """(the head profile, checked against the model; the layers Select serves), read once."""
    from spin_cluster.hplb.profile import load_profile
    from spin_cluster.models.config import ModelConfig

    return load_profile(profile_path, model_path=model_path), ModelConfig.from_folder(model_path).full_attention_layers()


def _cache_sizes(engine: SpinConfig) -> dict:
    """cache.kv_cache_gib and host_kv_gib of ``engine``: every page of scheduler.max_num_seqs
    requests of model.max_model_len tokens in either tier (``sizing.full_length_bytes``),
    instead of the engine's machine-wide defaults."""
    from spin_cluster.engine.device import resolve_device, resolve_dtype
    from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY
    from spin_cluster.kvcache.sizing import full_length_bytes

    mo = engine.model
    dtype = resolve_dtype(mo.dtype, resolve_device(mo.device))
    gpu_bytes, host_bytes = full_length_bytes(engine, mo.checkpoint_config(), dtype, mo.max_model_len,
                                              DEFAULT_POLICY.segment_pages)
    return {"kv_cache_gib": gpu_bytes / 2**30, "host_kv_gib": host_bytes / 2**30}
