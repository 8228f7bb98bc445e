"""Head placement: which head-parallel rank attends with which KV head of each layer.

Why per layer. Head-parallel ranks meet at every layer's output-projection all-reduce, so a
decode step costs, summed over layers, the *slowest* rank's attention time of that layer::

    makespan = sum_l max_r load[l][r],      load[l][r] = sum of cost[l][h] over the KV heads
                                                         h of layer l that rank r owns

A placement that balanced each rank's total over all layers could still leave one rank
with every expensive head of layer 0 and another with those of layer 1: the totals match,
yet each layer waits for one rank. So each layer's KV heads are partitioned on their own
(multiway number partitioning, S-HPLB's formulation), and a rank may own different,
non-contiguous heads in different layers.

Cost. A KV head's decode cost is the tokens it reads, ``sink + local + budget`` (clamped to
the context), times the query heads that share it (``G``): the G query heads of a GQA group
read the same K/V, so a group is never split and the unit placed is the KV head.

Greedy. S-HPLB's heuristic is LPT: sort the heads by cost, largest first, and give each to
the least-loaded rank (a heap: O(Hkv log Hkv + Hkv log R) per layer, O(N log N) in all for
N = L * Hkv heads). LPT's makespan is within 4/3 - 1/(3R) of the optimum, but it can lose
to the plain contiguous split, e.g. costs (3, 3, 2, 2, 2) on two ranks: LPT gives 7 | 5,
contiguous 6 | 6. ``greedy_placement`` therefore keeps, per layer, the better of the two
(contiguous on a tie, since it needs no weight permutation), which makes "never worse than
contiguous" true by construction and keeps the 4/3 bound.

Exact for small layers. Models place few KV heads per layer (8 for Llama-3.1-8B and most
GQA models), and for a layer of up to 8 the optimum is a branch and bound of a few hundred
nodes (``exact_layer``), so ``greedy_placement`` takes it there: on synthetic S-HPLB budgets
(Llama-3.1-8B, 2 ranks, 4 heads each) LPT's makespan is 1.059 of the ideal, the optimum's
1.041. LPT remains for wider layers.

Equal head counts. The offloaded Spin cache of a rank is [L, W]-shaped, W the most KV heads
any rank owns in any layer, and a padding column still runs the per-head steps whose cost does
not follow the budget (the Select over every page, the Index append). LPT free to give one
rank 5 heads of 8 would widen every rank to W = 5 against the contiguous split's 4.
``max_heads`` caps each rank's heads per layer (``ceil(Hkv / R)`` for that cache: the
contiguous split's width): LPT then gives each head to the least-loaded rank that still has
room. Contiguous meets the cap, so "never worse than contiguous" still holds.

Memory is not balanced here: the GPU-only cache stores a head's whole context whatever its
budget, so a rank's pages follow its number of heads, not its cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PLACEMENT_METHODS = ("greedy", "contiguous")


@dataclass(frozen=True)
class HeadPlacement:
    """Each (layer, KV head)'s rank and cost; immutable and JSON-able (``to_dict``).

    kv_head_to_rank: [L][Hkv] rank in 0 .. num_ranks - 1 of each KV head (and its G query
    heads). costs: [L][Hkv] the cost the placement balanced, >= 0 (tokens read x query heads).
    """

    num_ranks: int
    kv_head_to_rank: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, ...], ...]
    method: str = "given"

    def __post_init__(self) -> None:
        ranks = tuple(tuple(int(r) for r in row) for row in self.kv_head_to_rank)
        costs = tuple(tuple(c for c in row) for row in self.costs)
        object.__setattr__(self, "kv_head_to_rank", ranks)
        object.__setattr__(self, "costs", costs)
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks={self.num_ranks}: must be >= 1")
        if not ranks or not ranks[0]:
            raise ValueError("a head placement needs at least one layer and one KV head")
        if any(len(row) != len(ranks[0]) for row in ranks):
            raise ValueError("kv_head_to_rank must have the same number of KV heads in every layer")
        if [len(row) for row in costs] != [len(row) for row in ranks]:
            raise ValueError("costs must have the shape [L][Hkv] of kv_head_to_rank")
        bad = sorted({r for row in ranks for r in row if not 0 <= r < self.num_ranks})
        if bad:
            raise ValueError(f"ranks {bad} are outside 0 .. {self.num_ranks - 1}")
        if any(c < 0 for row in costs for c in row):
            raise ValueError("head costs must be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.kv_head_to_rank)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_head_to_rank[0])

    def kv_heads_of(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """[L] ascending KV head ids that ``rank`` owns in each layer (possibly none)."""
        return tuple(tuple(h for h, r in enumerate(row) if r == rank) for row in self.kv_head_to_rank)

    def rank_loads(self) -> tuple[tuple[float, ...], ...]:
        """[L][R] summed cost of each rank's heads in each layer."""
        return tuple(_loads(c, r, self.num_ranks) for c, r in zip(self.costs, self.kv_head_to_rank))

    @property
    def makespan(self) -> float:
        """Sum over layers of the slowest rank's load: the step's attention critical path."""
        return sum(max(row) for row in self.rank_loads())

    @property
    def imbalance(self) -> float:
        """makespan / sum over layers of the mean rank load, minus 1 (0: perfectly balanced)."""
        mean = sum(sum(row) for row in self.rank_loads()) / self.num_ranks
        return self.makespan / mean - 1.0 if mean > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_ranks": self.num_ranks,
            "kv_head_to_rank": [list(row) for row in self.kv_head_to_rank],
            "costs": [list(row) for row in self.costs],
            "method": self.method,
        }

    def to_rank_heads(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """{rank: ((layer, KV head), ...)}: the heads each rank owns, layer by layer, ascending."""
        return {
            r: tuple((layer, h) for layer, row in enumerate(self.kv_heads_of(r)) for h in row)
            for r in range(self.num_ranks)
        }

    @classmethod
    def from_rank_heads(
        cls,
        rank_heads: Mapping[int, Iterable[tuple[int, int]]],
        costs: Sequence[Sequence[float]] | None = None,
        method: str = "given",
    ) -> HeadPlacement:
        """The inverse of ``to_rank_heads``: ranks 0 .. R-1, each (layer, KV head) of an
        [L][Hkv] grid owned by exactly one of them (L and Hkv: the largest ids + 1).

        costs: [L][Hkv]; None gives every head cost 1 (a rank -> heads mapping does not carry
        the costs it was balanced by, so ``makespan`` then counts heads)."""
        ranks = sorted(rank_heads)
        if not ranks or ranks != list(range(len(ranks))):
            raise ValueError(f"rank_heads must have the ranks 0 .. R-1 as keys, got {ranks}")
        owner: dict[tuple[int, int], int] = {}
        for r in ranks:
            for layer, h in rank_heads[r]:
                pair = (int(layer), int(h))
                if min(pair) < 0:
                    raise ValueError(f"(layer, KV head) {pair}: ids must be >= 0")
                if pair in owner:
                    raise ValueError(f"(layer, KV head) {pair} is owned by ranks {owner[pair]} and {r}")
                owner[pair] = r
        if not owner:
            raise ValueError("rank_heads owns no head")
        num_layers = 1 + max(layer for layer, _ in owner)
        num_kv_heads = 1 + max(h for _, h in owner)
        missing = [(layer, h) for layer in range(num_layers) for h in range(num_kv_heads) if (layer, h) not in owner]
        if missing:
            raise ValueError(f"(layer, KV head) pairs {missing[:5]} are owned by no rank")
        rows = [[owner[(layer, h)] for h in range(num_kv_heads)] for layer in range(num_layers)]
        if costs is None:
            costs = [[1] * num_kv_heads] * num_layers
        return cls(len(ranks), rows, costs, method)

    @classmethod
    def from_dict(cls, data: dict) -> HeadPlacement:
        known = {"num_ranks", "kv_head_to_rank", "costs", "method"}
        if not isinstance(data, dict) or set(data) - known or not {"num_ranks", "kv_head_to_rank", "costs"} <= set(data):
            raise ValueError(f"a head placement is a mapping with keys {sorted(known)} (method optional)")
        return cls(data["num_ranks"], data["kv_head_to_rank"], data["costs"], data.get("method", "given"))


def head_costs(
    budgets: Sequence[Sequence[int]],
    *,
    sink_tokens: int,
    local_tokens: int,
    num_kv_groups: int,
    context_tokens: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """[L][Hkv] decode cost of each KV head: tokens read x query heads per KV head.

    budgets: [L][Hkv] middle-page budgets in tokens (``sparse.options.per_head_budgets``).
    context_tokens: clamp the tokens read to the context (a head cannot read more).
    """
    if num_kv_groups < 1 or sink_tokens < 0 or local_tokens < 0:
        raise ValueError("num_kv_groups must be >= 1, sink_tokens and local_tokens >= 0")
    cap = context_tokens if context_tokens is not None else float("inf")
    return tuple(
        tuple(int(min(cap, sink_tokens + local_tokens + int(b))) * num_kv_groups for b in row)
        for row in budgets
    )


def contiguous_layer(num_kv_heads: int, num_ranks: int) -> tuple[int, ...]:
    """Tensor parallelism's split: consecutive blocks, the first Hkv % R ranks one head larger."""
    base, extra = divmod(num_kv_heads, num_ranks)
    return tuple(r for r in range(num_ranks) for _ in range(base + (r < extra)))


def lpt_layer(costs: Sequence[float], num_ranks: int, max_heads: int | None = None) -> tuple[int, ...]:
    """LPT: heads by cost (largest first, lower id on a tie) to the least-loaded rank (lower
    id) among those owning fewer than ``max_heads`` heads (None: no cap)."""
    cap = len(costs) if max_heads is None else max_heads
    if cap * num_ranks < len(costs):
        raise ValueError(f"max_heads={max_heads} x {num_ranks} ranks cannot hold {len(costs)} KV heads")
    ranks = [0] * len(costs)
    owned = [0] * num_ranks
    heap = [(0.0, r) for r in range(num_ranks)]  # (load, rank): already a heap
    for h in sorted(range(len(costs)), key=lambda h: -costs[h]):
        load, r = heapq.heappop(heap)
        ranks[h] = r
        owned[r] += 1
        if owned[r] < cap:  # a full rank leaves the heap
            heapq.heappush(heap, (load + costs[h], r))
    return tuple(ranks)


EXACT_MAX_HEADS = 8


def exact_layer(costs: Sequence[float], num_ranks: int, max_heads: int | None = None) -> tuple[int, ...]:
    """The partition of smallest max load (at most ``max_heads`` heads per rank), by branch and
    bound from LPT's: heads largest first, ranks of equal (load, heads) tried once, a branch
    cut as soon as it cannot beat the best found. For a layer of <= ``EXACT_MAX_HEADS`` heads
    this is at most R^8 leaves, in practice a few hundred nodes."""
    n = len(costs)
    cap = n if max_heads is None else max_heads
    best_ranks = list(lpt_layer(costs, num_ranks, max_heads))
    best = max(_loads(costs, best_ranks, num_ranks))
    order = sorted(range(n), key=lambda h: -costs[h])
    loads, owned, ranks = [0.0] * num_ranks, [0] * num_ranks, [0] * n

    def search(i: int) -> None:
        nonlocal best, best_ranks
        if i == n:
            if max(loads) < best:
                best, best_ranks = max(loads), list(ranks)
            return
        h, tried = order[i], set()
        for r in range(num_ranks):
            key = (loads[r], owned[r])
            if owned[r] >= cap or key in tried or loads[r] + costs[h] >= best:
                continue
            tried.add(key)
            loads[r] += costs[h]
            owned[r] += 1
            ranks[h] = r
            search(i + 1)
            loads[r] -= costs[h]
            owned[r] -= 1

    search(0)
    return tuple(best_ranks)


def contiguous_placement(costs: Sequence[Sequence[float]], num_ranks: int) -> HeadPlacement:
    _check_ranks(costs, num_ranks)
    hkv = len(costs[0])
    return HeadPlacement(num_ranks, [contiguous_layer(hkv, num_ranks)] * len(costs), costs, "contiguous")


def greedy_placement(costs: Sequence[Sequence[float]], num_ranks: int, max_heads: int | None = None) -> HeadPlacement:
    """Per layer, the better (smaller max load) of the contiguous split and the best partition
    found (at most ``max_heads`` heads per rank, at least the contiguous split's ceil(Hkv / R)):
    the exact one for layers of up to ``EXACT_MAX_HEADS`` KV heads, LPT's above."""
    _check_ranks(costs, num_ranks)
    rows = []
    for layer_costs in costs:
        contiguous = contiguous_layer(len(layer_costs), num_ranks)
        search = exact_layer if len(layer_costs) <= EXACT_MAX_HEADS else lpt_layer
        found = search(layer_costs, num_ranks, max_heads)  # lpt_layer refuses a cap too small
        better = max(_loads(layer_costs, found, num_ranks)) < max(_loads(layer_costs, contiguous, num_ranks))
        rows.append(found if better else contiguous)
    return HeadPlacement(num_ranks, rows, costs, "greedy")


def place_heads(costs: Sequence[Sequence[float]], num_ranks: int, method: str = "greedy",
                max_heads: int | None = None) -> HeadPlacement:
    """``max_heads``: greedy's cap on a rank's KV heads per layer (see the module notes)."""
    if method == "greedy":
        return greedy_placement(costs, num_ranks, max_heads)
    if method == "contiguous":
        return contiguous_placement(costs, num_ranks)
    raise ValueError(f"placement method {method!r}: choose one of {', '.join(PLACEMENT_METHODS)}")


def _check_ranks(costs: Sequence[Sequence[float]], num_ranks: int) -> None:
    if not costs or not costs[0]:
        raise ValueError("costs must be [L][Hkv] with at least one layer and one KV head")
    if not 1 <= num_ranks <= len(costs[0]):
        raise ValueError(
            f"num_ranks={num_ranks}: head parallelism splits each layer's {len(costs[0])} KV heads, "
            f"so use 1 .. {len(costs[0])} ranks"
        )


def _loads(costs: Sequence[float], ranks: Sequence[int], num_ranks: int) -> tuple[float, ...]:
    loads = [0] * num_ranks
    for c, r in zip(costs, ranks):
        loads[r] += c
    return tuple(loads)
