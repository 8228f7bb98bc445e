"""Per-head budgets by max-min shifting (S-HPLB): a constant total, moved from sparse heads
to dense heads.

Uniform top-k gives every (layer, KV head) the same middle budget. Heads differ: some
recover nearly all their attention mass with a page or two, others need many. Max-min
shifting moves budget, one unit (a page) at a time, away from the heads that lose least by
it and to the head that is worst served, for as long as this raises the worst head. Its end
point is the max-min allocation of the total:

    maximise   min over heads h of  level_h(b_h)
    subject to sum_h b_h = total,   b_h >= floor,   b_h a multiple of the unit

where level_h is the attention mass head h recovers at budget b_h (from a ``HeadProfile``)
or, given only per-head needs n_h, the share of its need it gets, min(1, b_h / n_h). The
allocation is computed directly by water-filling: every head starts at its floor and each
unit goes to the head whose level is lowest (ties: the larger gain, then the smaller
budget, then the lower index). With non-decreasing levels that is the max-min optimum; once
every head is saturated the rest is dealt out evenly. The total is kept exactly.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence

import numpy as np

from spin_cluster.hplb.profile import HeadProfile

Budgets = tuple[tuple[int, ...], ...]


def maxmin_budgets(needs_or_profile: HeadProfile | Sequence[Sequence[int]], total_tokens: int,
                   floor_tokens: int = 0, *, unit_tokens: int | None = None,
                   context_tokens: int | None = None, layers: Sequence[int] | None = None,
                   other_tokens: int = 0) -> Budgets:
    """[L][Hkv] middle-token budgets summing to ``total_tokens`` exactly, each >= ``floor_tokens``.

    layers: the layers whose heads share ``total_tokens`` (None: every layer); the others'
        heads take no part and get ``other_tokens`` each (a model's sliding-window layers,
        which keep their window whatever their budget says).

    needs_or_profile: a ``HeadProfile`` (levels: recovered attention mass at
        ``context_tokens``, default the profile's longest context) or [L][Hkv] tokens each
        head needs (levels: the share of its need it gets).
    unit_tokens: granularity of every budget; default the profile's page size (what the
        engine's Select counts in), 1 for plain needs. ``total_tokens`` must be a multiple;
        the floor is rounded up to one.
    """
    shape, level = _levels(needs_or_profile, context_tokens)
    unit = unit_tokens or (needs_or_profile.page_size if isinstance(needs_or_profile, HeadProfile) else 1)
    shared = sorted(set(range(shape[0]) if layers is None else layers))
    if not shared or shared[0] < 0 or shared[-1] >= shape[0]:
        raise ValueError(f"layers {list(layers or [])}: give one or more of the profile's layers 0..{shape[0] - 1}")
    heads = [layer * shape[1] + h for layer in shared for h in range(shape[1])]  # flat ids of the sharing heads
    num_heads = len(heads)
    if unit < 1:
        raise ValueError(f"unit_tokens={unit}: must be >= 1")
    if total_tokens < 0 or total_tokens % unit:
        raise ValueError(f"total_tokens={total_tokens}: give a multiple of {unit} tokens (the budget unit) >= 0")
    floor_units = -(-max(0, floor_tokens) // unit)
    spare = total_tokens // unit - floor_units * num_heads
    if spare < 0:
        raise ValueError(
            f"total_tokens={total_tokens} cannot give {num_heads} heads a floor of {floor_units * unit} tokens "
            f"each ({floor_units * unit * num_heads} in all); lower floor_tokens or raise the total"
        )
    units = dict.fromkeys(heads, floor_units)
    heap = [_entry(level, h, floor_units, unit) for h in heads]
    heapq.heapify(heap)
    for _ in range(spare):
        h = heapq.heappop(heap)[-1]
        units[h] += 1
        heapq.heappush(heap, _entry(level, h, units[h], unit))
    flat = [units[h] * unit if h in units else other_tokens for h in range(shape[0] * shape[1])]
    return tuple(tuple(flat[i * shape[1]:(i + 1) * shape[1]]) for i in range(shape[0]))


def synthetic_maxmin_budgets(num_layers: int, num_kv_heads: int, mean_tokens: int, unit_tokens: int,
                             sigma: float = 0.8, seed: int = 0) -> Budgets:
    """S-HPLB budgets for a model without a profile (random weights at benchmark shapes):
    seeded log-normal needs per (layer, KV head), max-min shifted to the uniform total of
    ``mean_tokens`` (rounded down to whole units) per head."""
    rng = np.random.default_rng(seed)
    needs = np.maximum(unit_tokens, (rng.lognormal(0.0, sigma, (num_layers, num_kv_heads)) * mean_tokens).astype(int))
    total = num_layers * num_kv_heads * (mean_tokens // unit_tokens) * unit_tokens
    return maxmin_budgets(needs.tolist(), total, unit_tokens=unit_tokens)


def synthetic_prefill_fractions(num_layers: int, num_kv_heads: int, mean_fraction: float,
                                sigma: float = 0.6, seed: int = 0) -> list[list[float]]:
    """Per-(layer, KV head) block fractions of sparse prefill for a model without a profile:
    seeded log-normal, each in [0.01, 0.99], rescaled to a mean of ``mean_fraction``."""
    rng = random.Random(seed)
    rows = [[min(0.99, max(0.01, rng.lognormvariate(0, sigma) * mean_fraction)) for _ in range(num_kv_heads)]
            for _ in range(num_layers)]
    mean = sum(map(sum, rows)) / (num_layers * num_kv_heads)
    return [[round(min(0.99, b * mean_fraction / mean), 3) for b in row] for row in rows]


def synthetic_prefill_config(num_layers: int, num_kv_heads: int, mean_fraction: float, block_size: int = 128,
                             estimator: str = "strided", stride: int = 16) -> dict:
    """A ``sparse.prefill`` section for a model without a profile: block-sparse prefill with
    ``synthetic_prefill_fractions`` as its per-head budgets (the benchmarks' setting)."""
    return {"algorithm": "block", "options": {
        "block_size": block_size, "estimator": estimator, "stride": stride, "budgets": "per_head",
        "per_head_budgets": synthetic_prefill_fractions(num_layers, num_kv_heads, mean_fraction)}}


def uniform_budgets(num_layers: int, num_kv_heads: int, tokens: int) -> Budgets:
    """[L][Hkv] every head at ``tokens``: the top-k baseline as a budget table."""
    return ((tokens,) * num_kv_heads,) * num_layers


def total_tokens(budgets: Budgets) -> int:
    return sum(sum(row) for row in budgets)


def shifted_tokens(budgets: Budgets, uniform_tokens: int) -> int:
    """Tokens moved away from uniform to reach ``budgets`` (half the L1 distance)."""
    return sum(abs(b - uniform_tokens) for row in budgets for b in row) // 2


def _entry(level: Callable[[int, int], float], head: int, units: int, unit: int) -> tuple:
    now = level(head, units * unit)
    gain = level(head, (units + 1) * unit) - now
    return (now, -gain, units, head)


def _levels(source, context_tokens: int | None) -> tuple[tuple[int, int], Callable[[int, int], float]]:
    """(L, Hkv) and level(flat head, budget tokens) -> 0..1 of ``source``."""
    if isinstance(source, HeadProfile):
        hkv = source.num_kv_heads
        return (source.num_layers, hkv), lambda h, b: float(source.recovered(divmod(h, hkv), b, context_tokens))
    needs = np.asarray(source, dtype=float)
    if needs.ndim != 2 or needs.size == 0:
        raise ValueError(f"needs must be a non-empty [L][Hkv] table of tokens, got shape {needs.shape}")
    if (needs < 0).any():
        raise ValueError("needs must be >= 0 tokens")
    flat = needs.reshape(-1)
    return needs.shape, lambda h, b: 1.0 if flat[h] <= 0 else min(1.0, b / flat[h])
