"""What is compared: a sparse algorithm at a budget, and the engine settings that make it.

    dense                 every page (the reference), GPU-only paged cache
    ALGORITHM at BUDGET   the offloaded cache (Spin) with sparse.algorithm / sparse.budget;
                          BUDGET: middle tokens per head, a fraction (0, 1) of the context
                          or a token count (>= 1); sink and local tokens come on top

Window-only algorithms (streaming) score no middle page, so the budget would change nothing;
they get the budget as a wider local window instead, so that at every budget each method
attends to the same number of tokens (sink + budget + local).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

# Algorithms whose Select keeps only sink and local pages (see the module docstring).
WINDOW_ONLY = frozenset({"streaming"})


@dataclass(frozen=True)
class Method:
    algorithm: str
    budget: float | None = None  # None for dense; fraction (0, 1) of the context, or tokens

    def __post_init__(self) -> None:
        cls = _algorithm(self.algorithm)  # unknown names: the registry's ValueError
        if cls.selects_all and self.budget is not None:
            raise ValueError(f"{self.algorithm!r} attends to every page; it takes no budget")
        if not cls.selects_all and (self.budget is None or not self.budget > 0):
            raise ValueError(f"{self.algorithm!r} needs a budget > 0 (a fraction in (0, 1) or tokens)")

    @property
    def is_dense(self) -> bool:
        return self.budget is None

    @property
    def offloaded(self) -> bool:
        """Runs on the offloaded cache; only "dense" itself runs on the GPU-only one."""
        return self.algorithm != "dense"

    @property
    def label(self) -> str:
        return self.algorithm if self.is_dense else f"{self.algorithm} {budget_label(self.budget)}"

    def budget_tokens(self, context_tokens: int) -> int:
        """Middle tokens per head at this context length (the engine's rounding)."""
        if self.budget is None:
            return context_tokens
        return int(self.budget) if self.budget >= 1 else max(1, int(self.budget * context_tokens))

    def sparse_options(self, context_tokens: int, sink_tokens: int, local_tokens: int) -> dict:
        """The ``sparse`` config section for prompts of about ``context_tokens`` tokens."""
        if self.is_dense:
            return {"algorithm": self.algorithm}
        if self.algorithm in WINDOW_ONLY:
            local_tokens += self.budget_tokens(context_tokens)
        return {"algorithm": self.algorithm, "budget": self.budget,
                "sink_tokens": sink_tokens, "local_tokens": local_tokens}

    def depends_on_length(self) -> bool:
        """Whether ``sparse_options`` changes with the context (then one engine per length)."""
        return self.algorithm in WINDOW_ONLY and self.budget is not None and self.budget < 1


def budget_label(budget: float) -> str:
    """0.125 -> '1/8', 0.3 -> '0.3', 256 -> '256 tok'."""
    if budget >= 1:
        return f"{int(budget)} tok"
    frac = Fraction(budget).limit_denominator(4096)
    if frac.numerator == 1 and float(frac) == budget:
        return f"1/{frac.denominator}"
    return f"{budget:g}"


def make_methods(algorithms: Sequence[str], budgets: Sequence[float]) -> list[Method]:
    """Dense (always: it is the reference) first, then each sparse algorithm at each budget."""
    out = [Method("dense")]
    for name in algorithms:
        cls = _algorithm(name)
        if cls.selects_all:
            if name != "dense":
                out.append(Method(name))
            continue
        if not budgets:
            raise ValueError(f"algorithm {name!r} needs at least one budget (--budgets)")
        out.extend(Method(name, float(b)) for b in budgets)
    return list(dict.fromkeys(out))  # repeated names or budgets run once


def _algorithm(name: str):
    """The registry's class; unknown names raise its ValueError. Imported here so that the
    command line parser builds without importing torch."""
    from spin_cluster.partition import get_algorithm

    return get_algorithm(name)
