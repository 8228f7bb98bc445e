"""Greedy head placement against the exhaustive optimum and the contiguous split."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spin_cluster.hplb.placement import (
    HeadPlacement,
    contiguous_layer,
    EXACT_MAX_HEADS,
    contiguous_placement,
    exact_layer,
    greedy_placement,
    head_costs,
    lpt_layer,
    place_heads,
)


def optimal_makespan(costs: list[int], num_ranks: int) -> int:
    """Smallest max rank load over every assignment (up to relabelling the ranks)."""
    order = sorted(costs, reverse=True)
    loads = [0] * num_ranks
    best = [sum(costs)]

    def assign(i: int) -> None:
        if i == len(order):
            best[0] = min(best[0], max(loads))
            return
        tried = set()
        for r in range(num_ranks):
            if loads[r] in tried or loads[r] + order[i] >= best[0]:
                continue  # same load: same subtree; or no better than the best found
            tried.add(loads[r])
            loads[r] += order[i]
            assign(i + 1)
            loads[r] -= order[i]

    assign(0)
    return best[0]


@st.composite
def layers_and_ranks(draw):
    num_ranks = draw(st.integers(2, 4))
    num_heads = draw(st.integers(num_ranks, 12))
    num_layers = draw(st.integers(1, 3))
    # Small ranges make the ties and near-ties where LPT loses to the contiguous split.
    cost = st.integers(0, draw(st.sampled_from([4, 10, 1000])))
    costs = [draw(st.lists(cost, min_size=num_heads, max_size=num_heads)) for _ in range(num_layers)]
    return costs, num_ranks


@settings(max_examples=300, deadline=None)
@given(layers_and_ranks())
@example(([[2, 2, 2, 3, 3]], 2))  # LPT alone: 7 | 5, contiguous 6 | 6
def test_greedy_within_lpt_bound_of_optimum_and_never_worse_than_contiguous(case):
    costs, num_ranks = case
    greedy = greedy_placement(costs, num_ranks)
    optimum = sum(optimal_makespan(row, num_ranks) for row in costs)
    assert optimum <= greedy.makespan <= (4 / 3 - 1 / (3 * num_ranks)) * optimum + 1e-9
    if len(costs[0]) <= EXACT_MAX_HEADS:
        assert greedy.makespan == optimum
    assert greedy.makespan <= contiguous_placement(costs, num_ranks).makespan
    # Every layer is a partition of its KV heads over the ranks.
    for layer, row in enumerate(greedy.kv_head_to_rank):
        owned = sorted(h for r in range(num_ranks) for h in greedy.kv_heads_of(r)[layer])
        assert owned == list(range(len(row)))


@settings(max_examples=200, deadline=None)
@given(layers_and_ranks())
def test_capped_greedy_keeps_the_contiguous_width_and_never_loses_to_it(case):
    costs, num_ranks = case
    cap = -(-len(costs[0]) // num_ranks)
    greedy = greedy_placement(costs, num_ranks, max_heads=cap)
    assert greedy.makespan <= contiguous_placement(costs, num_ranks).makespan
    for layer in range(len(costs)):
        heads = [greedy.kv_heads_of(r)[layer] for r in range(num_ranks)]
        assert max(map(len, heads)) <= cap
        assert sorted(h for owned in heads for h in owned) == list(range(len(costs[0])))


def test_capped_lpt_balances_among_ranks_with_room():
    costs = [12, 3, 3, 3, 1, 1, 1, 1]
    assert lpt_layer(costs, 2) == (0, 1, 1, 1, 1, 1, 1, 0)  # 13 | 12, but 2 heads | 6 heads
    assert lpt_layer(costs, 2, max_heads=4) == (0, 1, 1, 1, 1, 0, 0, 0)  # 15 | 10, 4 heads each
    assert greedy_placement([costs], 2, max_heads=4).makespan == 15  # contiguous: 21 | 4
    with pytest.raises(ValueError, match="cannot hold 8 KV heads"):
        lpt_layer(costs, 2, max_heads=3)
    with pytest.raises(ValueError, match="max_heads=3"):
        greedy_placement([costs], 2, max_heads=3)


def test_exact_layer_beats_capped_lpt_where_lpt_is_not_optimal():
    costs = [7, 7, 1, 8, 5, 4]
    assert lpt_layer(costs, 2, max_heads=3) == (1, 1, 1, 0, 0, 0)  # 17 | 15
    assert exact_layer(costs, 2, max_heads=3) == (0, 1, 0, 0, 1, 1)  # 16 | 16
    assert greedy_placement([costs], 2, max_heads=3).makespan == 16


def test_lpt_can_lose_to_contiguous_and_greedy_keeps_contiguous():
    costs = [3, 3, 2, 2, 2]
    assert lpt_layer(costs, 2) == (0, 1, 0, 1, 0)  # loads 7 | 5
    assert contiguous_layer(5, 2) == (0, 0, 0, 1, 1)  # loads 8 | 4
    assert greedy_placement([costs], 2).makespan == 6  # exact at 5 heads: 3+3 | 2+2+2
    assert greedy_placement([costs * 2], 2).makespan == 12  # 10 heads, past the exact search: LPT's 12 | 12
    swapped = [2, 2, 2, 3, 3]  # contiguous 6 | 6 beats LPT's 7 | 5
    placement = greedy_placement([swapped], 2)
    assert placement.kv_head_to_rank == ((0, 0, 0, 1, 1),)
    assert placement.makespan == 6


def test_greedy_balances_a_skewed_layer_non_contiguously():
    costs = [[100, 90, 10, 5, 80, 70, 20, 15]]
    placement = greedy_placement(costs, 2)
    assert placement.kv_head_to_rank == ((0, 1, 1, 0, 1, 0, 0, 1),)
    assert placement.rank_loads() == ((195, 195),)
    assert placement.imbalance == 0.0
    contiguous = contiguous_placement(costs, 2)
    assert contiguous.rank_loads() == ((205, 185),)
    assert contiguous.imbalance == pytest.approx(205 / 195 - 1)


def test_layers_are_placed_independently():
    costs = [[10, 1, 1, 1], [1, 1, 1, 10]]
    placement = greedy_placement(costs, 2)
    assert placement.makespan == 20  # each layer: the 10 alone, 3 on the other rank
    assert placement.kv_heads_of(0) != placement.kv_heads_of(1)


def test_head_costs_count_sink_local_budget_and_query_heads():
    costs = head_costs([[100, 0], [5000, 10]], sink_tokens=4, local_tokens=16, num_kv_groups=3, context_tokens=1000)
    assert costs == ((360, 60), (3000, 90))


def test_placement_round_trips_through_json_and_is_frozen():
    placement = place_heads([[4, 3, 2, 1], [1, 2, 3, 4]], 2)
    again = HeadPlacement.from_dict(json.loads(json.dumps(placement.to_dict())))
    assert again == placement
    with pytest.raises(AttributeError):
        placement.num_ranks = 3


def test_placement_round_trips_through_rank_heads():
    """The planner hands engines {rank: ((layer, KV head), ...)}; the engine rebuilds the placement."""
    placement = place_heads([[4, 3, 2, 1], [1, 2, 3, 4]], 2)
    heads = placement.to_rank_heads()
    assert set(heads) == {0, 1}
    assert sorted(p for pairs in heads.values() for p in pairs) == [(lay, h) for lay in range(2) for h in range(4)]
    assert all(pair in heads[placement.kv_head_to_rank[pair[0]][pair[1]]] for pair in heads[0] + heads[1])
    again = HeadPlacement.from_rank_heads(heads, placement.costs, placement.method)
    assert again == placement
    unit = HeadPlacement.from_rank_heads({1: [(0, 1)], 0: [(0, 0)]})
    assert unit.kv_head_to_rank == ((0, 1),) and unit.costs == ((1, 1),)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: HeadPlacement.from_rank_heads({0: [(0, 0)], 2: [(0, 1)]}), r"ranks 0 \.\. R-1 as keys"),
        (lambda: HeadPlacement.from_rank_heads({0: [(0, 0), (0, 1)], 1: [(0, 1)]}), r"owned by ranks 0 and 1"),
        (lambda: HeadPlacement.from_rank_heads({0: [(0, 0)], 1: [(1, 1)]}),
         r"\(0, 1\), \(1, 0\)\] are owned by no rank"),
        (lambda: place_heads([[1, 2]], 3), "use 1 .. 2 ranks"),
        (lambda: place_heads([[1, 2]], 2, method="random"), "choose one of greedy, contiguous"),
        (lambda: HeadPlacement(2, [[0, 2]], [[1, 1]]), r"ranks \[2\] are outside"),
        (lambda: HeadPlacement(2, [[0, 1], [0]], [[1, 1], [1]]), "same number of KV heads"),
        (lambda: HeadPlacement.from_dict({"ranks": 2}), "a head placement is a mapping"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
