import dataclasses

import pytest
import torch

from spin_cluster.kernels.page_select import select_ragged_ref
from spin_cluster.sparse import SelectPlan, get_algorithm, registered_algorithms, select_pages


def _plan(num_pages, sink=1, local=2, budget=2, tail=3, hkv=2):
    n = torch.tensor(num_pages)
    b = torch.full((len(num_pages), hkv), budget) if isinstance(budget, int) else torch.tensor(budget)
    return SelectPlan(
        num_pages=n, tail_len=torch.full((len(num_pages),), tail, dtype=torch.int32), sink_pages=sink,
        local_pages=local, budget_pages=b, max_pages=max(num_pages), max_budget=int(b.max()),
    )


def test_top_pages_per_head_plus_sink_and_local_in_page_order():
    plan = _plan([8, 3], budget=[[2, 1], [2, 2]])
    scores = torch.zeros(2, 2, 8)
    scores[0, 0, [2, 5, 4]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 1, [4, 1]] = torch.tensor([5.0, 4.0])
    want, n = select_pages(scores, False, plan, 2)
    assert want.tolist() == [
        [[0, 2, 5, 6, 7], [0, 4, 6, 7, -1]],
        [[0, 1, 2, -1, -1], [0, 1, 2, -1, -1]],  # 3 pages: sink + local cover them all
    ]
    assert n.tolist() == [[5, 4], [3, 3]]


def test_the_fused_select_kernel_has_the_same_contract():
    """On CUDA, select_pages runs kernels/page_select.select_ragged (tested against
    select_ragged_ref under the interpreter); here the reference meets the torch path."""
    g = torch.Generator().manual_seed(0)
    plan = _plan([40, 9, 23], sink=2, local=3, budget=torch.randint(0, 9, (3, 2), generator=g).tolist())
    scores = torch.randn(3, 2, 40, generator=g).round(decimals=1)
    width = plan.sink_pages + plan.max_budget + plan.local_pages
    ref = select_ragged_ref(scores, plan.num_pages, plan.sink_pages, plan.local_pages, plan.budget_pages, width)
    got = select_pages(scores, False, plan, 2)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_streaming_takes_only_sink_and_local_and_dense_takes_all():
    plan = _plan([6])
    want, n = select_pages(None, False, plan, 2)
    assert want.tolist() == [[[0, 4, 5], [0, 4, 5]]]
    want, n = select_pages(None, True, plan, 2)
    assert want.tolist() == [[[0, 1, 2, 3, 4, 5]] * 2] and n.tolist() == [[6, 6]]


def test_a_budget_covering_the_middle_pages_selects_them_all():
    scores = torch.randn(2, 2, 12, generator=torch.Generator().manual_seed(0))
    plan = _plan([12, 7], budget=[[9, 9], [4, 4]])  # middle: 9 and 4 pages
    want, n = select_pages(scores, False, plan, 2)
    assert n.tolist() == [[12, 12], [7, 7]]
    assert want[0].tolist() == [list(range(12))] * 2 and want[1, :, :7].tolist() == [list(range(7))] * 2


def test_rows_under_the_budget_floor_take_every_middle_page_whatever_the_rule():
    dense_rows = torch.tensor([True, False])
    plan = dataclasses.replace(_plan([6, 6], budget=4), dense_rows=dense_rows)
    want, n = select_pages(None, False, plan, 2)  # a window-only algorithm: no scores
    assert n.tolist() == [[6, 6], [3, 3]]
    assert want[0].tolist() == [list(range(6))] * 2 and want[1, :, :3].tolist() == [[0, 4, 5]] * 2
    peaked = torch.zeros(2, 2, 6)
    peaked[:, :, 2] = 50.0  # top-p 0.5 wants page 2 alone
    plan = dataclasses.replace(plan, top_p=0.5, max_budget=8)
    want, n = select_pages(peaked, False, plan, 2)
    assert n.tolist() == [[6, 6], [4, 4]]


def test_registry_and_unknown_algorithm():
    assert {"dense", "streaming"} <= set(registered_algorithms())
    with pytest.raises(ValueError, match="unknown sparse algorithm 'nope'; choose one of"):
        get_algorithm("nope")
