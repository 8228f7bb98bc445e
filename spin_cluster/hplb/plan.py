"""S-HPLB's chain in one call: a profile's per-head budgets, then their head-to-rank placement.

    profile (or a needs table, or nothing)
        │  max-min shifting of the uniform total (budget.maxmin_budgets)
        ▼
    [L][Hkv] budgets ──costs (placement.head_costs)──▶ greedy partition onto the ranks
        ▼
    HeadPlan: budgets + HeadPlacement (makespan, imbalance)

Without a profile the budgets are the configured ones: ``per_head_budgets`` if given
(``sparse.options.per_head_budgets``), else the uniform budget for every head, whose equal
costs give the contiguous split. One rank owns every head. The serving planner, the
evaluation tools, the head-parallel engine and the block-sparse prefill all plan through
``plan_heads``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spin_cluster.hplb.budget import Budgets, maxmin_budgets, uniform_budgets
from spin_cluster.hplb.placement import PLACEMENT_METHODS, HeadPlacement, head_costs, place_heads
from spin_cluster.hplb.profile import HeadProfile

ROUNDINGS = ("up", "down")


@dataclass(frozen=True)
class PlanConfig:
    """What ``plan_heads`` needs besides the profile: the head grid, the uniform budget whose
    total is shifted, and the costs' terms.

    num_layers, num_kv_heads: the [L][Hkv] grid, >= 1 each.
    num_kv_groups: query heads per KV head (G), >= 1; a head's cost is its tokens x G.
    context_tokens: the longest context a head reads, >= 1; costs are clamped to it, and the
        first ``dense_layers`` layers cost all of it.
    budget_tokens: the uniform middle budget per head in tokens, >= 0 (``sparse.budget`` at
        ``context_tokens``); a profile shifts its total, the uniform rounded to whole units.
    unit_tokens: the budgets' granularity in tokens, >= 1; None: the profile's page size
        (what Select counts in), 1 for a needs table.
    sink_tokens, local_tokens: always-read tokens of every head, >= 0 (cost terms only).
    dense_layers: the first N layers attend densely, >= 0 (cost terms only).
    per_head_budgets: [L][Hkv] given middle budgets in tokens, used when there is no profile.
    floor_fraction: each shifted head keeps at least this share of the uniform budget, 0..1.
    floor_tokens: and at least this many tokens, >= 0 (at most the uniform budget):
        ``sparse.budget_floor_tokens``, the fewest tokens a head may read and still keep a
        needle, which a fractional budget never goes under either. Where the uniform budget is
        the floor itself (a short context at a small fraction), no head can give any away and
        the budgets stay uniform. (On Gemma-3-270M at 8K and 16K, Quest's S-HPLB budgets
        without it took one global layer to 1616 tokens under the 2048-token floor and found
        28 and 19 pass keys of 36 against uniform's 29 and 25: ``docs/accuracy.md``.)
    profile_context_tokens: the context the profile's curves are read at; None: its longest.
    rounding: "up" rounds the uniform budget and the floor up to whole units (as the engine's
        Select takes pages), "down" rounds both down (the uniform to at least one unit).
    max_heads_per_rank: greedy's cap on a rank's KV heads per layer is ceil(Hkv / R) (the
        offloaded cache, whose rank width is the most heads a rank owns in a layer).
    method: "greedy" or "contiguous" (``placement.PLACEMENT_METHODS``).
    sparse_layers: the layers Select serves, whose heads share the shifted total; None: every
        layer. A model's sliding-window layers (Gemma 3) keep only their window: their heads
        take no part and keep the uniform budget, which no Select reads.
    """

    num_layers: int
    num_kv_heads: int
    context_tokens: int
    budget_tokens: int
    num_kv_groups: int = 1
    unit_tokens: int | None = None
    sink_tokens: int = 0
    local_tokens: int = 0
    dense_layers: int = 0
    per_head_budgets: Budgets | None = None
    floor_fraction: float = 0.0
    floor_tokens: int = 0
    profile_context_tokens: int | None = None
    rounding: str = "up"
    max_heads_per_rank: bool = False
    method: str = "greedy"
    sparse_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.num_kv_groups, self.context_tokens) < 1:
            raise ValueError("num_layers, num_kv_heads, num_kv_groups and context_tokens must be >= 1")
        if self.budget_tokens < 0 or self.unit_tokens is not None and self.unit_tokens < 1:
            raise ValueError(f"budget_tokens={self.budget_tokens} must be >= 0, unit_tokens={self.unit_tokens} >= 1")
        if not 0 <= self.floor_fraction <= 1:
            raise ValueError(f"floor_fraction={self.floor_fraction}: use a share of the uniform budget in [0, 1]")
        if self.floor_tokens < 0:
            raise ValueError(f"floor_tokens={self.floor_tokens} must be >= 0")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding {self.rounding!r}: choose one of {', '.join(ROUNDINGS)}")
        if self.method not in PLACEMENT_METHODS:
            raise ValueError(f"placement method {self.method!r}: choose one of {', '.join(PLACEMENT_METHODS)}")
        if self.sparse_layers is not None and (not self.sparse_layers or min(self.sparse_layers) < 0
                                               or max(self.sparse_layers) >= self.num_layers):
            raise ValueError(f"sparse_layers {self.sparse_layers}: give one or more of layers 0..{self.num_layers - 1}")


@dataclass(frozen=True)
class HeadPlan:
    """budgets: [L][Hkv] middle budgets in tokens (a needs table's units), >= 0; the placement
    balanced their costs (the first ``dense_layers`` layers' at the whole context).
    per_head: whether they are per-head budgets (shifted by a profile, or given) rather than
    the uniform budget, so that an engine takes them as ``sparse.options.per_head_budgets``.
    placement: each (layer, KV head)'s rank; makespan and imbalance are its cost model's."""

    budgets: Budgets
    per_head: bool
    placement: HeadPlacement

    @property
    def makespan(self) -> float:
        return self.placement.makespan

    @property
    def imbalance(self) -> float:
        return self.placement.imbalance

    def sparse_options(self, options: dict | None = None) -> dict:
        """The ``sparse`` section's update for an engine run on this plan ({} when uniform): the
        budgets as ``options.per_head_budgets``, beside ``options`` (the section's own now)."""
        return {"options": {**(options or {}), "per_head_budgets": self.budgets}} if self.per_head else {}


def plan_heads(profile: HeadProfile | Sequence[Sequence[float]] | None, config: PlanConfig,
               num_ranks: int = 1) -> HeadPlan:
    """Budgets for every (layer, KV head) and their placement onto ``num_ranks`` ranks.

    profile: a ``HeadProfile`` (levels: recovered mass), an [L][Hkv] table of needs in tokens
        (levels: the share of its need a head gets), or None (the configured budgets).
    """
    if profile is None:
        budgets, per_head = _configured_budgets(config)
    else:
        budgets, per_head = _shifted_budgets(profile, config), True
    _check_shape(budgets, config)
    return HeadPlan(budgets, per_head, _placement(budgets, config, num_ranks))


def _configured_budgets(c: PlanConfig) -> tuple[Budgets, bool]:
    if c.per_head_budgets is not None:
        return tuple(tuple(row) for row in c.per_head_budgets), True
    return uniform_budgets(c.num_layers, c.num_kv_heads, c.budget_tokens), False


def _shifted_budgets(profile: HeadProfile | Sequence[Sequence[float]], c: PlanConfig) -> Budgets:
    """Max-min shifting of the uniform total (uniform in whole units, times the heads)."""
    unit = c.unit_tokens or (profile.page_size if isinstance(profile, HeadProfile) else 1)
    if c.rounding == "up":
        uniform = -(-c.budget_tokens // unit) * unit
        floor = max(math.ceil(c.floor_fraction * uniform), -(-c.floor_tokens // unit) * unit)
    else:
        uniform = max(unit, c.budget_tokens // unit * unit)
        floor = max(math.floor(c.floor_fraction * uniform), c.floor_tokens // unit * unit)
    floor = min(floor, uniform)
    layers = c.sparse_layers
    total = uniform * (c.num_layers if layers is None else len(set(layers))) * c.num_kv_heads
    return maxmin_budgets(profile, total, floor, unit_tokens=unit, context_tokens=c.profile_context_tokens,
                          layers=layers, other_tokens=uniform)


def _placement(budgets: Budgets, c: PlanConfig, num_ranks: int) -> HeadPlacement:
    # Dense layers read the whole context whatever their budgets say.
    read = [[c.context_tokens] * c.num_kv_heads if layer < c.dense_layers else row for layer, row in enumerate(budgets)]
    costs = head_costs(read, sink_tokens=c.sink_tokens, local_tokens=c.local_tokens,
                       num_kv_groups=c.num_kv_groups, context_tokens=c.context_tokens)
    max_heads = -(-c.num_kv_heads // num_ranks) if c.max_heads_per_rank and num_ranks >= 1 else None
    return place_heads(costs, num_ranks, c.method, max_heads)


def _check_shape(budgets: Budgets, c: PlanConfig) -> None:
    if len(budgets) != c.num_layers or any(len(row) != c.num_kv_heads for row in budgets):
        raise ValueError(
            f"sparse.options.per_head_budgets must be [{c.num_layers}][{c.num_kv_heads}] (layers x KV heads) "
            "for this model"
        )
