import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spin_cluster.hplb.budget import maxmin_budgets, shifted_tokens, total_tokens, uniform_budgets
from spin_cluster.hplb.profile import FamilyCurves, HeadProfile


def _profile(mass, context=1024, page_size=16):
    mass = np.asarray(mass, dtype=float)
    return HeadProfile(model={"name": "toy"}, page_size=page_size, sink_tokens=16, local_tokens=64,
                       queries_per_prompt=4, context_tokens=(context,),
                       fractions=np.linspace(0, 1, mass.shape[-1]), families={"all": FamilyCurves(3, mass)})


def test_needs_proportional_with_floors():
    # 2 layers x 2 heads; the units left after the floors follow the needs
    budgets = maxmin_budgets([[0, 10], [30, 60]], total_tokens=40, floor_tokens=2)
    assert budgets == ((2, 4), (12, 22))  # levels 1, 0.4, 0.4, 0.37: no integer split raises 0.37
    assert total_tokens(budgets) == 40


def test_saturated_heads_share_the_rest_evenly():
    assert maxmin_budgets([[1, 2]], total_tokens=9) == ((5, 4),)


def test_profile_moves_pages_from_sparse_heads_to_dense_heads():
    x = np.linspace(0, 1, 65)
    sparse = np.minimum(1, 0.9 + x)  # 90% with no middle page at all
    dense = np.sqrt(x)  # needs much of the context
    profile = _profile([[sparse, dense]])
    uniform = 4 * 16  # 4 pages each
    budgets = maxmin_budgets(profile, total_tokens=2 * uniform, floor_tokens=16)
    assert budgets == ((16, 112),)
    assert shifted_tokens(budgets, uniform) == 48
    low_uniform = min(profile.recovered((0, h), uniform) for h in range(2))
    low_maxmin = min(profile.recovered((0, h), b) for h, b in enumerate(budgets[0]))
    assert low_maxmin > low_uniform


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="multiple of 16"):
        maxmin_budgets(_profile(np.ones((1, 2, 5))), total_tokens=100)
    with pytest.raises(ValueError, match="lower floor_tokens"):
        maxmin_budgets([[1, 1]], total_tokens=10, floor_tokens=6)
    with pytest.raises(ValueError, match=r"\[L\]\[Hkv\]"):
        maxmin_budgets([1, 2], total_tokens=10)
    with pytest.raises(ValueError, match=">= 0"):
        maxmin_budgets([[-1, 2]], total_tokens=10)


def test_uniform_table():
    assert uniform_budgets(2, 3, 64) == ((64, 64, 64), (64, 64, 64))


needs_tables = st.integers(1, 4).flatmap(
    lambda layers: st.integers(1, 4).flatmap(
        lambda heads: st.lists(st.lists(st.integers(0, 500), min_size=heads, max_size=heads),
                               min_size=layers, max_size=layers)))


@settings(max_examples=150, deadline=None)
@given(needs=needs_tables, unit=st.sampled_from([1, 4, 16]), per_head=st.integers(0, 40), floor=st.integers(0, 40))
def test_total_is_kept_exactly_and_floors_hold(needs, unit, per_head, floor):
    num_heads = len(needs) * len(needs[0])
    total = unit * per_head * num_heads
    floor_units = -(-floor // unit)
    if floor_units * num_heads > per_head * num_heads:
        with pytest.raises(ValueError):
            maxmin_budgets(needs, total, floor, unit_tokens=unit)
        return
    budgets = maxmin_budgets(needs, total, floor, unit_tokens=unit)
    flat = [b for row in budgets for b in row]
    assert [len(row) for row in budgets] == [len(row) for row in needs]
    assert sum(flat) == total
    assert all(b >= floor and b % unit == 0 for b in flat)
    # max-min: the worst-served head is served at least as well as under uniform budgets
    level = [min(1.0, b / n) if n else 1.0 for b, n in zip(flat, (n for row in needs for n in row))]
    uniform = [min(1.0, unit * per_head / n) if n else 1.0 for row in needs for n in row]
    if floor_units <= per_head:
        assert min(level) >= min(uniform) - 1e-12


@settings(max_examples=60, deadline=None)
@given(increments=st.lists(st.lists(st.floats(0, 1), min_size=9, max_size=9), min_size=1, max_size=6),
       per_head=st.integers(0, 8), floor=st.integers(0, 3))
def test_profile_budgets_keep_the_total_and_floors(increments, per_head, floor):
    mass = np.cumsum(np.asarray(increments), axis=-1)
    mass = mass / np.maximum(mass[:, -1:], 1e-9)  # non-decreasing curves ending at 1
    profile = _profile(mass[None], context=128)
    total = 16 * per_head * mass.shape[0]
    if floor > per_head:
        with pytest.raises(ValueError, match="floor"):
            maxmin_budgets(profile, total, 16 * floor)
        return
    budgets = maxmin_budgets(profile, total, 16 * floor)
    flat = budgets[0]
    assert sum(flat) == total and all(b >= 16 * floor and b % 16 == 0 for b in flat)
    worst = min(profile.recovered((0, h), b) for h, b in enumerate(flat))
    assert worst >= min(profile.recovered((0, h), 16 * per_head) for h in range(len(flat))) - 1e-9


def test_synthetic_prefill_fractions_are_seeded_bounded_and_keep_the_mean():
    from spin_cluster.hplb.budget import synthetic_prefill_fractions

    rows = synthetic_prefill_fractions(32, 8, 0.125)
    assert rows == synthetic_prefill_fractions(32, 8, 0.125) != synthetic_prefill_fractions(32, 8, 0.125, seed=1)
    flat = [f for row in rows for f in row]
    assert len(rows) == 32 and all(len(row) == 8 for row in rows)
    assert all(0 < f <= 0.99 for f in flat) and len(set(flat)) > 100  # heads differ
    assert abs(sum(flat) / len(flat) - 0.125) < 1e-3


def test_only_the_sharing_layers_split_the_total():
    """A model's sliding-window layers take no part: the full-attention layers' heads share
    the total (their uniform budget times their count) and the others keep ``other_tokens``."""
    needs = [[0, 0], [10, 30], [0, 0], [40, 0]]
    budgets = maxmin_budgets(needs, total_tokens=4 * 20, layers=[1, 3], other_tokens=20)
    assert budgets[0] == budgets[2] == (20, 20)
    assert sum(budgets[1]) + sum(budgets[3]) == 80 and budgets[1][1] == 30 and budgets[3][0] == 40
    with pytest.raises(ValueError, match="layers"):
        maxmin_budgets(needs, total_tokens=80, layers=[4])
