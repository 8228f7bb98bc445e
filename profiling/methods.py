"""What is compared: a sparse algorithm at a budget, and the engine settings that make it.

    dense                 every page (the reference), GPU-only paged cache
    ALGORITHM at BUDGET   the offloaded cache (Spin) with sparse.algorithm / sparse.budget;
                          BUDGET: middle tokens per head, a fraction (0, 1) of the context
                          or a token count (>= 1); sink and local tokens come on top

Window-only algorithms (streaming) score no middle page, so the budget would change nothing;
they get the budget as a wider local window instead, so that at every budget each method
attends to the same number of tokens (sink + budget + local).

A scored algorithm's budget is spread over heads in one of ``BUDGET_MODES``, all at the same
total (the uniform budget times the number of (layer, KV head) pairs):

    uniform   every head takes its top BUDGET pages (top-k)
    top_p     online: per step each head takes its fewest top pages reaching mass p, a layer's
              heads sharing their uniform total (``sparse.options.top_p``)
    maxmin    offline: S-HPLB per-head budgets by max-min shifting over a head profile
              (``sparse.options.per_head_budgets``, ``spin_cluster.hplb``); fixed tokens per length

    config NAME           a bundled serving config (``bundled.py``): its whole sparse section
                          (block-sparse prefill included) and its page size and host dtype

    dense + prefill MODE at F   dense decode after block-sparse prefill (``sparse.prefill``)
                                computing the key blocks of uniform budget F (a fraction of
                                each query block's middle blocks): MODE uniform, threshold
                                (XAttention) or hplb (S-HPLB per-head budgets), the latter two
                                calibrated to uniform's block count (``sparse.prefill.calibrate``)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from spin_cluster.config import SparseConfig
from spin_cluster.sparse.budget import budget_tokens

# Algorithms whose Select keeps only sink and local pages (see the module docstring).
WINDOW_ONLY = frozenset({"streaming"})
PREFILL_MODES = ("uniform", "threshold", "hplb")
BUDGET_MODES = ("uniform", "top_p", "maxmin")
_MODE_LABELS = {"uniform": "", "top_p": " top-p", "maxmin": " max-min"}


@dataclass(frozen=True)
class Method:
    algorithm: str
    budget: float | None = None  # None for dense; fraction (0, 1) of the context, or tokens
    prefill: str | None = None  # block-sparse prefill budgets (PREFILL_MODES); None: dense prefill
    prefill_budget: float | None = None  # its uniform-equivalent fraction of the middle blocks
    budget_mode: str = "uniform"  # how decode budgets spread over heads (BUDGET_MODES)
    config: str | None = None  # a bundled config's name (or YAML path): its sparse section as is

    @classmethod
    def bundled(cls, name: str) -> Method:
        """The bundled config ``name``, labelled by it; its algorithm and budget checked here."""
        from spin_cluster.profiling import bundled

        sparse = bundled.load(name)["sparse"]
        return cls(sparse.get("algorithm", "dense"), sparse.get("budget"), config=name)

    def __post_init__(self) -> None:
        if self.prefill is not None and (self.prefill not in PREFILL_MODES or not 0 < (self.prefill_budget or 0) < 1):
            raise ValueError(f"prefill {self.prefill!r} at {self.prefill_budget}: choose one of "
                             f"{', '.join(PREFILL_MODES)} and a fraction in (0, 1)")
        cls = _algorithm(self.algorithm)  # unknown names: the registry's ValueError
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget mode {self.budget_mode!r}: choose one of {', '.join(BUDGET_MODES)}")
        if self.budget_mode != "uniform" and (cls.selects_all or self.algorithm in WINDOW_ONLY):
            raise ValueError(f"budget mode {self.budget_mode!r} needs an algorithm that scores pages, "
                             f"not {self.algorithm!r}")
        if cls.selects_all and self.budget is not None:
            raise ValueError(f"{self.algorithm!r} attends to every page; it takes no budget")
        if not cls.selects_all and (self.budget is None or not self.budget > 0):
            raise ValueError(f"{self.algorithm!r} needs a budget > 0 (a fraction in (0, 1) or tokens)")

    @property
    def is_dense(self) -> bool:
        return self.budget is None

    @property
    def offloaded(self) -> bool:
        """Runs on the offloaded cache; only "dense" itself (and a bundled config of the
        paged cache) runs on the GPU-only one."""
        if self.config is not None:
            return self.bundled_sections()["cache"].get("kind", "paged") == "offloaded"
        return self.algorithm != "dense"

    def bundled_sections(self) -> dict:
        from spin_cluster.profiling import bundled

        return bundled.load(self.config)

    @property
    def label(self) -> str:
        if self.config is not None:  # a bundled name, or a YAML file's stem
            return self.config.removesuffix(".yaml").rsplit("/", 1)[-1]
        label = self.algorithm if self.is_dense else f"{self.algorithm} {budget_label(self.budget)}"
        label += _MODE_LABELS[self.budget_mode]
        if self.prefill is not None:
            label += f" + prefill {self.prefill} {budget_label(self.prefill_budget)}"
        return label

    def budget_tokens(self, context_tokens: int, floor_tokens: int = 0) -> int:
        """Middle tokens per head at this context length under a budget floor of
        ``floor_tokens`` (``sparse.budget_floor_tokens``; 0: off), as the engine counts them."""
        if self.budget is None:
            return context_tokens
        sparse = SparseConfig(budget=self.budget, budget_floor_tokens=floor_tokens)
        return budget_tokens(sparse, context_tokens)

    def sparse_options(self, context_tokens: int, sink_tokens: int, local_tokens: int, floor_tokens: int = 0) -> dict:
        """The ``sparse`` config section for prompts of about ``context_tokens`` tokens, with
        the budget floor ``floor_tokens`` (0: off, each Select measured at its own budget).
        A bundled config's section is its own, whatever the arguments."""
        if self.config is not None:
            return dict(self.bundled_sections()["sparse"])
        if self.is_dense:
            return {"algorithm": self.algorithm}
        if self.algorithm in WINDOW_ONLY:
            local_tokens += self.budget_tokens(context_tokens, floor_tokens)
        return {"algorithm": self.algorithm, "budget": self.budget, "budget_floor_tokens": floor_tokens,
                "sink_tokens": sink_tokens, "local_tokens": local_tokens}

    @property
    def sparse_prefill(self) -> bool:
        """Prefills block-sparsely: a prefill mode, or a bundled config with a prefill section."""
        if self.config is not None:
            return (self.bundled_sections()["sparse"].get("prefill") or {}).get("algorithm") == "block"
        return self.prefill is not None

    def depends_on_length(self) -> bool:
        """Whether ``sparse_options`` changes with the context (then one engine per length)."""
        fixed_tokens = self.algorithm in WINDOW_ONLY or self.budget_mode == "maxmin"
        return fixed_tokens and self.budget is not None and self.budget < 1

    @property
    def series(self) -> str:
        """The label without the budget: one line of an accuracy-vs-budget plot."""
        return self.algorithm + _MODE_LABELS[self.budget_mode]


def budget_label(budget: float) -> str:
    """0.125 -> '1/8', 0.3 -> '0.3', 256 -> '256 tok'."""
    if budget >= 1:
        return f"{int(budget)} tok"
    frac = Fraction(budget).limit_denominator(4096)
    if frac.numerator == 1 and float(frac) == budget:
        return f"1/{frac.denominator}"
    return f"{budget:g}"


def make_methods(algorithms: Sequence[str], budgets: Sequence[float], prefill_modes: Sequence[str] = (),
                 prefill_budget: float = 0.25, budget_modes: Sequence[str] = ("uniform",),
                 configs: Sequence[str] = ()) -> list[Method]:
    """Dense (always: it is the reference) first, then the bundled ``configs``, then each sparse
    algorithm at each budget (in each of ``budget_modes`` if it scores pages), then dense decode
    after sparse prefill in each of ``prefill_modes``."""
    out = [Method("dense"), *(Method.bundled(name) for name in configs)]
    for name in algorithms:
        cls = _algorithm(name)
        if cls.selects_all:
            if name != "dense":
                out.append(Method(name))
            continue
        if not budgets:
            raise ValueError(f"algorithm {name!r} needs at least one budget (--budgets)")
        modes = ("uniform",) if name in WINDOW_ONLY else budget_modes
        out.extend(Method(name, float(b), budget_mode=mode) for b in budgets for mode in modes)
    out.extend(Method("dense", prefill=mode, prefill_budget=prefill_budget) for mode in prefill_modes)
    return list(dict.fromkeys(out))  # repeated names or budgets run once


def budget_mode_options(method: Method, context_tokens: int, *, page_size: int, top_p: float,
                        profile=None, floor_fraction: float = 0.25, floor_tokens: int = 0,
                        sparse_layers: tuple[int, ...] | None = None) -> dict:
    """``sparse`` options that spread ``method``'s budget in its mode at ``context_tokens``:
    {} (uniform), ``options.top_p``, or ``options.per_head_budgets`` from ``profile`` (a ``HeadProfile``) whose
    total is the uniform budget in whole pages times the heads, each head at least
    ``floor_fraction`` of the uniform budget and ``floor_tokens`` (the budget floor).
    ``sparse_layers``: the layers Select serves (the full-attention ones of a model with
    sliding windows), whose heads alone share the total; None: every layer."""
    if method.budget_mode == "top_p":
        return {"options": {"top_p": top_p}}
    if method.budget_mode != "maxmin":
        return {}
    from spin_cluster.hplb import PlanConfig, plan_heads

    if profile is None:
        raise ValueError("budget mode 'maxmin' needs a head profile: `spin-cluster profile --out F`, then --profile F")
    if profile.page_size != page_size:
        raise ValueError(f"the head profile counts pages of {profile.page_size} tokens, the run {page_size}: "
                         f"profile again with the run's page size")
    # The uniform budget in whole pages, rounded up as Select takes them; read at this length.
    config = PlanConfig(num_layers=profile.num_layers, num_kv_heads=profile.num_kv_heads,
                        context_tokens=context_tokens, budget_tokens=method.budget_tokens(context_tokens, floor_tokens),
                        unit_tokens=page_size, floor_fraction=floor_fraction, floor_tokens=floor_tokens,
                        profile_context_tokens=context_tokens,
                        sparse_layers=sparse_layers)
    return plan_heads(profile, config).sparse_options()


def _algorithm(name: str):
    """The registry's class; unknown names raise its ValueError. Imported here so that the
    command line parser builds without importing torch."""
    from spin_cluster.sparse import get_algorithm

    return get_algorithm(name)
