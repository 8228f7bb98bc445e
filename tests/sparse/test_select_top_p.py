"""Top-p Select: each head's fewest top pages reaching mass p, a request's heads sharing the
pages their budgets add up to."""

import math

import pytest
import torch

from spin_cluster.sparse import SelectPlan, select_pages


def _plan(top_p, budget=2, num_pages=10, hkv=2):
    # sink page 0, local page 9 (the tail), middle pages 1..8; each head may take up to the total
    return SelectPlan(
        num_pages=torch.tensor([num_pages]), tail_len=torch.tensor([4], dtype=torch.int32), sink_pages=1,
        local_pages=1, budget_pages=torch.full((1, hkv), budget), max_pages=num_pages, max_budget=budget * hkv,
        top_p=top_p,
    )


def _scores():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0, 3] = 10.0  # head 0: one page holds ~all the mass; head 1: flat
    return scores


def test_a_peaked_head_takes_one_page_and_a_flat_head_the_rest_of_the_total():
    want, n = select_pages(_scores(), False, _plan(0.9), 2)
    # head 1 wants 8 pages for 90% (7 give 87.5%) but the total is 2 x 2: it gets 3, first pages first
    assert want.tolist() == [[[0, 3, 9, -1, -1, -1], [0, 1, 2, 3, 9, -1]]]
    assert n.tolist() == [[3, 5]]


def test_top_p_takes_fewer_pages_than_the_total_when_the_mass_is_reached():
    want, n = select_pages(_scores(), False, _plan(0.2), 2)
    assert n.tolist() == [[3, 4]]  # head 1: 2 pages of 1/8 reach 20%
    assert want[0, 1, :4].tolist() == [0, 1, 2, 9]


def test_the_least_massive_wanted_pages_are_dropped_first():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0, [2, 4]] = torch.tensor([5.0, 4.0])  # head 0: two heavy pages
    scores[0, 1, 6] = math.log(7.0)  # head 1: page 6 holds 7/14 = 50%, others 1/14 each
    want, n = select_pages(scores, False, _plan(0.9, budget=1), 2)
    # wanted: head 0 pages 2, 4 (~73%, ~27%: 4 is needed to pass 90%), head 1 page 6 then 1, 2, ...
    # total 2: page 2 of head 0 (0.73) and page 6 of head 1 (0.5) are the most massive
    assert want.tolist() == [[[0, 2, 9, -1], [0, 6, 9, -1]]]


def test_score_scale_turns_scores_into_log_mass():
    scores = torch.zeros(1, 2, 10)
    scores[0, :, 3] = 10.0
    plan = _plan(0.9)
    sharp, _ = select_pages(scores, False, plan, 2)
    flat, n = select_pages(scores, False, SelectPlan(**{**plan.__dict__, "score_scale": 0.01}), 2)
    assert sharp[0, 0, :3].tolist() == [0, 3, 9]
    # at scale 0.01 the scores are nearly flat: both heads want all 8 pages, and share the total
    # of 4 by mass (page 3 of each first), ties between heads going to the lower head
    assert n.tolist() == [[5, 3]]


def test_forced_pages_with_infinite_scores_come_first():
    scores = torch.zeros(1, 2, 10)
    scores[0, :, 7] = float("inf")
    want, n = select_pages(scores, False, _plan(0.5), 2)
    assert want[0, :, :3].tolist() == [[0, 7, 9], [0, 7, 9]]


@pytest.mark.parametrize("p", [0.0, 1.5])
def test_config_rejects_a_mass_outside_0_1(p):
    from spin_cluster.config import SpinConfig

    with pytest.raises(ValueError, match=rf"^sparse.options.top_p={p}: must be "):
        SpinConfig.from_dict({"sparse": {"algorithm": "quest", "options": {"top_p": p}}})
