import numpy as np
import pytest

from spin_cluster.hplb import PlanConfig, plan_heads
from spin_cluster.hplb.budget import total_tokens
from spin_cluster.hplb.profile import FamilyCurves, HeadProfile


def _profile(num_layers=3, num_kv_heads=4, page_size=16):
    """Head (l, h) recovers mass like f ** (1 / (1 + (l + h) % 4)): heads differ in need."""
    fractions = np.linspace(0, 1, 33)
    mass = np.array([[fractions ** (1.0 / (1 + (layer + h) % 4)) for h in range(num_kv_heads)]
                     for layer in range(num_layers)])
    return HeadProfile(model={"name": "toy"}, page_size=page_size, sink_tokens=16, local_tokens=64,
                       queries_per_prompt=4, context_tokens=(1024,), fractions=fractions,
                       families={"all": FamilyCurves(3, mass)})


def _config(**kw) -> PlanConfig:
    return PlanConfig(**{"num_layers": 3, "num_kv_heads": 4, "num_kv_groups": 2, "context_tokens": 1024,
                         "budget_tokens": 128, "sink_tokens": 16, "local_tokens": 64, **kw})


def _owned(plan) -> list[tuple[int, int]]:
    return sorted(pair for heads in plan.placement.to_rank_heads().values() for pair in heads)


def test_a_profile_shifts_the_uniform_total_and_the_placement_covers_every_head_once():
    plan = plan_heads(_profile(), _config(floor_fraction=0.25), num_ranks=2)
    budgets = np.array(plan.budgets)
    assert budgets.shape == (3, 4) and total_tokens(plan.budgets) == 128 * 12  # the uniform total, kept
    assert budgets.min() >= 32 and budgets.max() > 128 and (budgets % 16 == 0).all()  # floors, shifted, pages
    assert plan.per_head and plan.sparse_options() == {"options": {"per_head_budgets": plan.budgets}}
    assert plan.sparse_options({"summary": "moments"}) == {"options": {"summary": "moments",
                                                                      "per_head_budgets": plan.budgets}}
    assert _owned(plan) == [(layer, h) for layer in range(3) for h in range(4)]
    assert plan.placement.num_ranks == 2 and plan.placement.method == "greedy"
    # The costs placed are the shifted budgets' (sink + local + budget) x G.
    assert plan.placement.costs == tuple(tuple((16 + 64 + b) * 2 for b in row) for row in plan.budgets)
    assert plan.makespan == plan.placement.makespan and plan.imbalance == plan.placement.imbalance


def test_one_rank_owns_every_head():
    plan = plan_heads(_profile(), _config(), num_ranks=1)
    assert plan.placement.kv_head_to_rank == ((0, 0, 0, 0),) * 3
    assert plan.imbalance == 0.0 and total_tokens(plan.budgets) == 128 * 12


def test_without_a_profile_the_uniform_budget_splits_contiguously():
    plan = plan_heads(None, _config(budget_tokens=100), num_ranks=2)
    assert plan.budgets == ((100,) * 4,) * 3 and not plan.per_head  # unrounded: no shifting
    assert plan.sparse_options() == {} and plan.sparse_options({"summary": "moments"}) == {}
    assert plan.placement.kv_head_to_rank == ((0, 0, 1, 1),) * 3 and plan.imbalance == 0.0


def test_without_a_profile_given_budgets_are_placed_as_they_are():
    given = ((100, 100, 10, 10),) * 3
    plan = plan_heads(None, _config(per_head_budgets=given, sink_tokens=0, local_tokens=0), num_ranks=2)
    assert plan.budgets == given and plan.per_head
    assert plan.placement.kv_head_to_rank == ((0, 1, 0, 1),) * 3 and plan.makespan == 3 * 110 * 2
    with pytest.raises(ValueError, match=r"must be \[3\]\[4\]"):
        plan_heads(None, _config(per_head_budgets=((1, 2),)), num_ranks=2)


def test_the_uniform_budget_rounds_to_whole_pages_up_or_down():
    up = plan_heads(_profile(), _config(budget_tokens=100, floor_fraction=0.25))
    down = plan_heads(_profile(), _config(budget_tokens=100, floor_fraction=0.25, rounding="down"))
    assert total_tokens(up.budgets) == 112 * 12 and total_tokens(down.budgets) == 96 * 12
    assert min(map(min, up.budgets)) >= 32 and min(map(min, down.budgets)) >= 16  # ceil / floor of 28 and 24
    tiny = plan_heads(_profile(), _config(budget_tokens=3, rounding="down"))
    assert total_tokens(tiny.budgets) == 16 * 12  # one page at least


def test_a_needs_table_is_shifted_in_its_own_units():
    needs = [[1, 10, 30, 60]]
    plan = plan_heads(needs, _config(num_layers=1, budget_tokens=10, unit_tokens=1))
    assert plan.budgets == ((1, 4, 12, 23),) and total_tokens(plan.budgets) == 40  # levels 1, .4, .4, .38


def test_dense_layers_cost_the_whole_context_and_the_offloaded_cache_caps_heads_per_rank():
    plan = plan_heads(None, _config(dense_layers=1), num_ranks=2)
    assert plan.placement.costs[0] == (1024 * 2,) * 4 and plan.placement.costs[1] == ((16 + 64 + 128) * 2,) * 4
    given = ((500, 1, 1, 1),)
    free = plan_heads(None, _config(num_layers=1, per_head_budgets=given), num_ranks=2)
    capped = plan_heads(None, _config(num_layers=1, per_head_budgets=given, max_heads_per_rank=True), num_ranks=2)
    assert sorted(free.placement.kv_head_to_rank[0]) == [0, 1, 1, 1]  # LPT: the big head alone
    assert sorted(capped.placement.kv_head_to_rank[0]) == [0, 0, 1, 1]  # at most ceil(4 / 2) heads a rank


def test_no_shifted_head_goes_under_the_budget_floor():
    """floor_tokens (the sparse config's budget floor): every head keeps that many tokens, and
    where the uniform budget is the floor itself the budgets stay uniform."""
    free = plan_heads(_profile(), _config(floor_fraction=0.25))
    assert min(map(min, free.budgets)) < 96  # without it the profile takes some heads down to 32
    floored = plan_heads(_profile(), _config(floor_fraction=0.25, floor_tokens=90))
    assert min(map(min, floored.budgets)) == 96 and total_tokens(floored.budgets) == 128 * 12  # 90 up to pages
    assert max(map(max, floored.budgets)) > 128  # still shifted above it
    at_floor = plan_heads(_profile(), _config(floor_fraction=0.25, floor_tokens=128))
    assert at_floor.budgets == ((128,) * 4,) * 3
    over = plan_heads(_profile(), _config(floor_tokens=4096))  # capped at the uniform budget
    assert over.budgets == ((128,) * 4,) * 3


@pytest.mark.parametrize("kw, match", [
    ({"floor_fraction": 1.5}, "floor_fraction"),
    ({"floor_tokens": -1}, "floor_tokens"),
    ({"rounding": "nearest"}, "choose one of up, down"),
    ({"method": "random"}, "choose one of greedy, contiguous"),
    ({"num_kv_heads": 0}, "must be >= 1"),
])
def test_bad_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_sliding_window_layers_keep_the_uniform_budget_and_share_nothing():
    """sparse_layers (Gemma 3's full-attention layers): only their heads share their uniform
    total; the other layers' heads keep the uniform budget, which no Select reads."""
    plan = plan_heads(_profile(), _config(floor_fraction=0.25, sparse_layers=(1,)))
    budgets = np.array(plan.budgets)
    assert (budgets[[0, 2]] == 128).all()
    assert budgets[1].sum() == 128 * 4 and budgets[1].max() > 128  # shifted among layer 1's heads alone
    with pytest.raises(ValueError, match="sparse_layers"):
        _config(sparse_layers=(3,))
