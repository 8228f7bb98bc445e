"""The Serve application's configuration: the engine's ``SpinConfig`` plus a ``serve`` section.

One YAML file holds both (``deployments/configs/*.yaml``)::

    model:     {path: null, max_model_len: null}      # SpinConfig sections, as in config.py
    scheduler: {max_num_seqs: 64}
    serve:     {max_waiting_requests: 256}            # ServeOptions below

``load_app_config`` reads a file and lays per-section overrides over it, so that a Serve
deploy config can say ``args: {config: default, model: {path: /models/x}}``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from spin_cluster.config import ConfigSection, SpinConfig, parse_config
from spin_cluster.engine.step_threads import BLOCK_TOKENS, StepThreads

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = "default"
# engine_torch_threads "auto": steps of this many tokens or more run on every CPU. Decode steps
# (at most max_num_seqs rows, 64 by default) stay on one thread; a prefill chunk of 512 tokens
# took 0.43 s on two threads.
AUTO_THREADS_MIN_TOKENS = 128
# A replica that fails to start this many times fails the deploy (Serve's
# max_constructor_retry_count): `spin-cluster serve` then exits with its reason, and a
# RayService shows the app DEPLOY_FAILED, instead of Serve starting it again for ever.
START_ATTEMPTS = 2


# Ray resource amounts: a number >= 0.
_Amount = Annotated[float, Field(ge=0)]


class ServeOptions(ConfigSection):
    model_name: str | None = Field(None, description="Name clients pass as `model`; null: the model folder's name.")
    num_engine_replicas: int = Field(1, ge=1, description="EngineServer replicas, one per node, >= 1.")
    engine_num_cpus: float = Field(1.0, ge=0, description="Logical Ray CPUs of one EngineServer replica, >= 0.")
    engine_num_gpus: float = Field(0.0, ge=0, description=(
        "Logical Ray GPUs of one EngineServer replica (that node's GPUs), >= 0."))
    # Served on 2 vCPUs under guidellm, "auto" gave 17.4, 42.7 and 68.3 tok/s at 1, 4 and 16
    # streams (medians of 3 runs), "all" 14.3, 34.4 and 49.0 (one run);
    # spin_cluster/engine/step_threads.py says why.
    engine_torch_threads: int | Literal["all", "auto"] | None = Field("auto", description=(
        "Torch threads of a plain engine replica (its GEMMs and attention): an integer >= 1, "
        '"all" (a CPU engine, engine_num_gpus 0: every CPU this process may run on; a GPU engine: '
        'Ray\'s), "auto" (a CPU engine: every CPU for steps of at least AUTO_THREADS_MIN_TOKENS '
        "tokens, prefill chunks, and one thread for smaller decode steps, leaving the other cores "
        "to the ingress, the proxy and Ray; a GPU engine: Ray's), or null: Ray's setting from "
        "engine_num_cpus (OMP_NUM_THREADS, at least 1)."))
    engine_resources: dict[str, _Amount] | None = Field(None, description=(
        "Custom Ray resources one EngineServer replica needs besides those, each amount >= 0: "
        '{"engine_node": 1} keeps engines on the nodes that offer "engine_node" (a KubeRay worker '
        "group's rayStartParams resources), so that the head keeps the ingress and the planner."))
    engine_ranks: StrictInt | None = Field(None, ge=1, description=(
        "Head-parallel ranks of one EngineServer replica (S-HPLB), >= 1: one process per rank "
        "(rank 0 the replica, the others Ray actors in its placement group, one bundle per rank of "
        "engine_num_cpus CPUs and, on GPUs, one GPU), each attending with its share of the KV heads "
        "(the planner's placement) and summing the attention output with the others'. At most "
        "engine_num_gpus ranks on GPUs; with engine_num_gpus 0 they are CPU processes. 1: the plain "
        "engine. null: one rank per GPU (at most one per KV head of the model), and 1 when the "
        "engine config cannot run head-parallel (block-sparse prefill, seer, top-p)."))
    # A first 128K request on a fresh GPU engine met ~10 kernel variants' compiles in its
    # steps (7 s at Llama-3.1-8B shapes on an H200); Triton keeps them on disk for restarts.
    warmup: StrictBool | None = Field(None, description=(
        "Before a plain engine replica takes requests, run one made-up prompt of each power of "
        "two of tokens from 1024 up to the model's context (128K at most), with a few decode "
        "steps after each (`Engine.warm_up`), so that no request waits for the kernels' "
        "per-length compiles; on the offloaded (Spin) cache, whose decode graphs are captured "
        "lazily, then a batch of made-up prompts that drains one request a step, so that "
        "every batch size's compiles are done too; the replica is ready once it is done (the "
        "prefill of about twice the context, e.g. ~25 s at 128K on an H200 at Llama-3.1-8B "
        "shapes, and the draining batch's prompts). null: on for an "
        "engine on CUDA, off on the CPU (whose kernels compile nothing per length). "
        "Head-parallel replicas skip it."))
    ingress_num_cpus: float = Field(0.1, gt=0, description="Logical Ray CPUs of the ingress, > 0.")
    planner_num_cpus: float = Field(0.1, gt=0, description="Logical Ray CPUs of the planner, > 0.")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description=(
        "Largest request body in bytes, >= 1024; larger ones get 413."))
    max_waiting_requests: int = Field(256, ge=0, description=(
        "Per engine: requests admitted but not yet running beyond which new ones get 429, >= 0."))
    handle_timeout_s: float = Field(30.0, gt=0, description=(
        "Seconds to wait for a planner or engine reply (routing, admission, stats), > 0."))
    token_timeout_s: float = Field(120.0, gt=0, description=(
        "Seconds to wait for a request's next output while it runs (one engine step), > 0."))
    stats_interval_s: float = Field(0.5, gt=0, description=(
        "Seconds between an engine's capacity/stats reports to the planner, > 0."))
    engine_stale_s: float = Field(5.0, gt=0, description=(
        "Seconds: an engine silent this long is dropped from routing and /health, > stats_interval_s."))
    drain_s: float = Field(20.0, ge=0, description=(
        "Seconds requests in flight get to finish after a SIGTERM, >= 0: `spin-cluster serve` "
        "answers new requests 503 meanwhile and ends what is left with an error event after it; "
        "each replica's graceful shutdown (Serve's graceful_shutdown_timeout_s) waits as long. "
        "The Helm chart gives pods this plus 10 s (terminationGracePeriodSeconds) and Ray's node "
        "drain this long (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)."))
    hplb_profile: str | None = Field(None, description=(
        "S-HPLB: the offline per-head profile (`spin-cluster profile --out F`) of this model. The "
        "planner shifts the uniform sparse.budget to per-head budgets at the same total (max-min) "
        "and places each engine's heads on its GPUs; null: the config's budgets as they are."))
    hplb_floor_fraction: float = Field(0.25, ge=0, le=1, description=(
        "Each head keeps at least this share of the uniform budget under max-min, 0..1."))

    @field_validator("engine_torch_threads", mode="before")
    @classmethod
    def _threads(cls, threads: Any) -> Any:
        if threads is None or threads in ("all", "auto") or (
                isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
            return threads
        raise ValueError('use an integer >= 1, "all", "auto" or null')

    @model_validator(mode="after")
    def _stale_after_reports(self) -> ServeOptions:
        if not self.engine_stale_s > self.stats_interval_s:
            raise ValueError(
                f"serve.engine_stale_s={self.engine_stale_s} must exceed "
                f"serve.stats_interval_s={self.stats_interval_s}"
            )
        if self.engine_ranks is not None and 0 < self.engine_num_gpus < self.engine_ranks:
            raise ValueError(
                f"serve.engine_ranks={self.engine_ranks} exceeds serve.engine_num_gpus={self.engine_num_gpus:g}: "
                "each head-parallel rank needs a GPU of its own"
            )
        return self

    def torch_threads(self) -> int | None:
        """The engine replica's torch thread count (with "auto", that of its large steps),
        None to leave Ray's."""
        if self.engine_torch_threads not in ("all", "auto"):
            return self.engine_torch_threads
        if self.engine_num_gpus > 0:  # a GPU engine
            return None
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def step_threads(self) -> StepThreads | None:
        """With "auto" on a CPU engine: torch threads chosen per step by its token count."""
        threads = self.torch_threads()
        if self.engine_torch_threads != "auto" or threads is None:
            return None
        return StepThreads(small=1, large=threads, min_tokens=AUTO_THREADS_MIN_TOKENS, block_tokens=BLOCK_TOKENS)


class AppConfig(ConfigSection):
    spin: SpinConfig = Field(default_factory=SpinConfig, description="The engine's config (spin_cluster.config).")
    serve: ServeOptions = Field(default_factory=ServeOptions, description="The Serve application's options.")

    @model_validator(mode="after")
    def _ranks_the_engine_can_run(self) -> AppConfig:
        ranks = self.serve.engine_ranks
        refusal = self.spin.head_parallel_refusal()
        if ranks is not None and ranks > 1 and refusal is not None:
            raise ValueError(f"serve.engine_ranks={ranks}: {refusal}, or set serve.engine_ranks: 1")
        return self

    def check_model(self) -> None:
        """Reads the model folder's ``config.json`` and raises ``ValueError`` where the config
        does not fit it or the engine could not run it: ``SpinConfig.check_model``, the sparse
        algorithm and its options, head-parallel ranks against the KV heads, a GPU device on
        engines that Ray gives no GPU. Run before Ray starts anything."""
        from spin_cluster.engine.cache_builder import check_cache_config

        mc = self.spin.model.checkpoint_config()
        self.spin.check_model(mc)
        check_cache_config(self.spin, self.spin.context_len(mc))
        ranks = self.serve.engine_ranks
        if ranks is not None and ranks > mc.num_kv_heads:
            raise ValueError(f"serve.engine_ranks={ranks} exceeds the model's num_key_value_heads="
                             f"{mc.num_kv_heads}: each head-parallel rank needs a KV head of its own")
        if self.spin.model.device.startswith("cuda") and self.serve.engine_num_gpus == 0:
            raise ValueError(f"model.device={self.spin.model.device!r} but serve.engine_num_gpus=0, so Ray gives "
                             "an engine no GPU: set serve.engine_num_gpus, or model.device: cpu (or auto)")

    def with_model_context(self) -> AppConfig:
        """This config with ``model.max_model_len`` set to the model's own context
        (``ModelConfig.context_len``) where it is null, so that every
        deployment (the ingress's model card and demand estimate, the planner's budgets, the
        engines) reads one number."""
        if self.spin.model.max_model_len is not None:
            return self
        mc = self.spin.model.checkpoint_config()
        model = self.spin.model.model_copy(update={"max_model_len": mc.context_len})
        return self.model_copy(update={"spin": self.spin.model_copy(update={"model": model})})

    def ranks_per_engine(self, num_kv_heads: int | None = None) -> int:
        """Head-parallel ranks of one engine replica: ``serve.engine_ranks`` when set, else
        one per GPU (``max(1, int(engine_num_gpus))``), at most ``num_kv_heads`` (the model's,
        when given: a rank needs a head), and 1 when the engine config cannot run head-parallel
        ranks (``SpinConfig.head_parallel_refusal``: one engine per replica, whatever its GPUs)."""
        if self.serve.engine_ranks is not None:
            return self.serve.engine_ranks
        if self.spin.head_parallel_refusal() is not None:
            return 1
        ranks = max(1, int(self.serve.engine_num_gpus))
        return ranks if num_kv_heads is None else max(1, min(ranks, num_kv_heads))

    @property
    def model_name(self) -> str:
        return self.serve.model_name or Path(self.spin.model.resolved_path()).name

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AppConfig:
        """One YAML file's sections: SpinConfig's and ``serve``."""
        data = dict(data or {})
        sections = set(SpinConfig.model_fields) | {"serve"}
        unknown = sorted(set(data) - sections)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown config section; known: {', '.join(sorted(sections))}")
        serve = parse_config(ServeOptions, data.pop("serve", None) or {}, ("serve",))
        return parse_config(cls, {"spin": SpinConfig.from_dict(data), "serve": serve})

    def to_dict(self) -> dict[str, Any]:
        return {**self.spin.to_dict(), "serve": self.serve.model_dump()}


def config_path(name: str | Path) -> Path:
    """A YAML path, or the name of a bundled config (``default``, ``spin``, ``spin-quest``, ``spin-fast``)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    bundled = CONFIG_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"config {str(name)!r} is neither a file nor a bundled config ({', '.join(names)})")


def read_config_file(name: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(config_path(name).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {name}: the top level must be a mapping of sections")
    return data


def load_app_config(args: dict[str, Any] | AppConfig | None = None) -> AppConfig:
    """``args``: {"config": file or bundled name, <section>: {key: value}, ...}.

    Sections given in ``args`` override the file's key by key."""
    if isinstance(args, AppConfig):
        return args
    args = dict(args or {})
    base = read_config_file(args.pop("config", None) or DEFAULT_CONFIG)
    return AppConfig.from_dict(merge_sections(base, args))


def merge_sections(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section] = {**out[section], **values}
        else:
            out[section] = values
    return out


# When set (to a non-empty key), /v1/* requires "Authorization: Bearer <key>". Read by the
# ingress replica from its own environment, so the key never travels in the Serve config.
API_KEY_ENV = "SPIN_API_KEY"


def rank_bundles(num_ranks: int, *, gpu: bool, num_cpus: float = 1.0,
                 resources: dict[str, float] | None = None) -> list[dict[str, float]]:
    """One placement-group bundle per rank: ``num_cpus`` CPUs and, on GPUs, one GPU each;
    ``resources`` (the replica's custom resources) only in bundle 0, rank 0's."""
    bundle = {"CPU": float(num_cpus), **({"GPU": 1.0} if gpu else {})}
    return [{**bundle, **(resources or {})}] + [dict(bundle) for _ in range(num_ranks - 1)]
