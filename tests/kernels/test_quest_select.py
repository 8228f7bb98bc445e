"""Quest's Select in two launches (``kernels/quest_select.py``) against ``select_layer``'s
separate steps: the same page ids in the same order and the same counts."""

import pytest
import torch

from spin_cluster.kernels.quest_select import fused_pays, quest_select, quest_select_ref, select_chunk
from spin_cluster.sparse import SelectPlan, get_algorithm, select_layer

from .conftest import check_impls

HKV, G, D, S = 2, 2, 16, 4


def _quest(P, rows, num_pages, seed, integer=False):
    """A Quest index over P pages per row, the rows' first num_pages pages written (random
    bounds; small integers with ``integer``, so that every score is exact and ties abound)."""
    quest = get_algorithm("quest")(num_layers=2, num_kv_heads=HKV, head_dim=D, page_size=S, max_seqs=4,
                          max_pages_per_seq=P, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for row, n in zip(rows.tolist(), num_pages.tolist()):
        if integer:
            a, b = torch.randint(-2, 3, (2, n, HKV, D), generator=g).float()
        else:
            a, b = torch.randn(2, n, HKV, D, generator=g)
        at = slice(row * P, row * P + n)
        quest.kmin[1, at], quest.kmax[1, at] = torch.minimum(a, b), torch.maximum(a, b)
    return quest


def _plan(P, num_pages, budgets, sink, local, dense_rows=None, max_budget=0):
    max_budget = max(max_budget, int(budgets.max()))
    return SelectPlan(num_pages=num_pages, tail_len=torch.ones_like(num_pages, dtype=torch.int32), sink_pages=sink,
                      local_pages=local, budget_pages=budgets, max_pages=P, max_budget=max_budget,
                      dense_rows=dense_rows)


def _fused(quest, q, rows, plan, held, resident_margin, chunk):
    """What ``Quest.select_top`` launches on CUDA, under the interpreter."""
    margin = resident_margin / (HKV / (q.shape[1] * D ** 0.5)) if resident_margin and held is not None else 0.0
    pages = quest._score_blocks(rows, plan.max_pages)
    return quest_select(q, quest.kmin[1], quest.kmax[1], pages, plan.num_pages, plan.sink_pages, plan.local_pages,
                        plan.budget_pages, plan.budget_width, held if margin else None, margin, plan.dense_rows,
                        chunk=chunk, impl="triton")


CASES = [  # (B, pages per row, sink, local, chunk)
    (1, [70], 1, 2, 16),
    (3, [70, 37, 9], 2, 3, 32),
    (3, [64, 5, 51], 1, 4, 64),  # a row whose sink and local windows overlap
    (2, [70, 70], 0, 1, 128),  # one chunk per row
]


@pytest.mark.parametrize("B, lengths, sink, local, chunk", CASES)
@pytest.mark.parametrize("resident_margin", [0.0, 0.5])
def test_fused_select_equals_select_layer(B, lengths, sink, local, chunk, resident_margin):
    P = 70
    g = torch.Generator().manual_seed(B * 100 + chunk)
    rows = torch.tensor([2, 0, 3])[:B]
    num_pages = torch.tensor(lengths)
    quest = _quest(P, rows, num_pages, seed=chunk)
    q = torch.randn(B, HKV * G, D, generator=g)
    budgets = torch.randint(0, 12, (B, HKV), generator=g)  # per-head budgets, 0 included
    budgets[0, 0] = 0
    dense = None
    if B > 1:  # the last row under the budget floor takes every middle page, whatever its budget
        dense = torch.zeros(B, dtype=torch.bool)
        dense[-1] = True
        budgets[-1, 0] = 0
    plan = _plan(P, num_pages, budgets, sink, local, dense, max_budget=lengths[-1])
    held = torch.rand(B, HKV, P, generator=g) < 0.3
    want, count = select_layer(quest, 1, q, rows, plan, held, resident_margin)  # the torch steps
    got, got_count = _fused(quest, q, rows, plan, held, resident_margin, chunk)
    assert torch.equal(got_count, count)
    assert torch.equal(got, want)
    assert got.shape == (B, HKV, plan.budget_width)
    if resident_margin:  # the margin moved pages: without it the selection differs
        plain = _fused(quest, q, rows, plan, held, 0.0, chunk)[0]
        assert not torch.equal(plain, got)


@pytest.mark.parametrize("chunk", [16, 64])
def test_ties_go_to_the_lower_page_across_chunks(chunk):
    # Integer bounds and queries: exact scores, many equal; a cut inside a run of ties.
    P, B = 70, 2
    rows, num_pages = torch.tensor([1, 3]), torch.tensor([70, 40])
    quest = _quest(P, rows, num_pages, seed=4, integer=True)
    q = torch.randint(-1, 2, (B, HKV * G, D), generator=torch.Generator().manual_seed(5)).float()
    quest.kmin[1, P:P + 70], quest.kmax[1, P:P + 70] = quest.kmin[1, P + 3].clone(), quest.kmax[1, P + 3].clone()  # row 0: ties
    budgets = torch.tensor([[5, 9], [3, 20]])
    plan = _plan(P, num_pages, budgets, 1, 2)
    held = torch.zeros(B, HKV, P, dtype=torch.bool)
    held[0, 1, 40:50] = True  # a held run outscores the tie: taken whole, then the lowest others
    got, count = _fused(quest, q, rows, plan, held, 0.5, chunk)
    pages = quest._score_blocks(rows, P)
    margin = 0.5 / (HKV / (q.shape[1] * D ** 0.5))
    ref = quest_select_ref(q, quest.kmin[1], quest.kmax[1], pages, num_pages, 1, 2, budgets, plan.budget_width,
                           held, margin)
    assert torch.equal(got, ref[0]) and torch.equal(count, ref[1])
    assert got[0, 0, :8].tolist() == [0, 1, 2, 3, 4, 5, 68, 69]  # five tied middle pages: the lowest
    assert got[0, 1, :13].tolist() == [0, 40, 41, 42, 43, 44, 45, 46, 47, 48, 68, 69, -1]
    assert count[0].tolist() == [8, 12]


def test_select_chunk_spreads_a_long_row_and_caps_the_candidates():
    assert select_chunk(5120, 74) == 512  # 128K tokens, 32-token pages, 2K budget: 10 chunks
    assert select_chunk(1024, 74) == 512  # 32K: 2 chunks
    assert select_chunk(5120, 600) == 2048
    assert select_chunk(40, 10) == 64  # no more than the row, no less than a scoring block


def test_impl_choice_and_checks():
    P, B = 20, 2
    rows, num_pages = torch.tensor([0, 1]), torch.tensor([20, 9])
    quest = _quest(P, rows, num_pages, seed=8)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, HKV * G, D, generator=g)
    pages = quest._score_blocks(rows, P)
    budgets = torch.tensor([[3, 0], [5, 20]])
    held = torch.rand(B, HKV, P, generator=g) < 0.5
    args = [q, quest.kmin[1], quest.kmax[1], pages, num_pages, 1, 2, budgets, 9, held, 2.0]
    check_impls(quest_select, quest_select_ref, lambda: (args, {}))
    with pytest.raises(ValueError, match="held must be"):
        quest_select_ref(*args[:9], held[:, :, :5], 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B, context", [(1, 131072), (4, 131072), (60, 32768)])
def test_fused_select_equals_the_separate_steps_on_gpu(index_dtype, B, context):
    """Llama-3.1-8B shapes (32 query heads, 8 KV heads, D 128, 32-token pages): ``select_layer``
    on CUDA, fused and not, page for page (the scores' float sums included), eager and in a
    CUDA graph; per-head budgets, the margin, a row under the budget floor, shorter rows."""
    from spin_cluster.hplb.budget import synthetic_maxmin_budgets

    dev = torch.device("cuda")
    hkv, H, D, S = 8, 32, 128, 32
    P = context // S + 256
    quest = get_algorithm("quest")(num_layers=1, num_kv_heads=hkv, head_dim=D, page_size=S, max_seqs=B,
                                   max_pages_per_seq=P, device=dev, index_dtype=index_dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    a = torch.randn(B * P, hkv, D, device=dev, generator=g)
    b = a + torch.rand(B * P, hkv, D, device=dev, generator=g)
    quest.kmin[0, :-1], quest.kmax[0, :-1] = a, b
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    rows = torch.arange(B, device=dev).flip(0)
    num_pages = torch.randint(P // 2, P + 1, (B,), device=dev, generator=g)
    num_pages[0] = P
    budgets = -(-torch.tensor(synthetic_maxmin_budgets(B, hkv, 2048, S), device=dev) // S)  # [B, Hkv] pages
    dense = torch.zeros(B, dtype=torch.bool, device=dev)
    if B > 1:
        num_pages[-1], budgets[-1], dense[-1] = 60, 60, True
    plan = SelectPlan(num_pages=num_pages, tail_len=torch.ones(B, dtype=torch.int32, device=dev), sink_pages=1,
                      local_pages=2, budget_pages=budgets, max_pages=P, max_budget=int(budgets.max()),
                      dense_rows=dense)
    held = torch.rand(B, hkv, P, device=dev, generator=g) < 0.2
    for margin in (0.0, 0.5):
        old = select_layer(quest, 0, q, rows, plan, held, margin, fused=False)
        new = select_layer(quest, 0, q, rows, plan, held, margin, fused=True)
        assert torch.equal(new[1], old[1]) and torch.equal(new[0], old[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = select_layer(quest, 0, q, rows, plan, held, margin, fused=True)
        graph.replay()
        assert torch.equal(out[0], old[0]) and torch.equal(out[1], old[1])


def test_the_fused_select_runs_only_where_it_was_measured_faster():
    """Many rows of narrow selections (60 x 32K, uniform budgets); not S-HPLB's wide heads,
    nor a batch of a few requests."""
    assert fused_pays(60 * 8, 67)
    assert not fused_pays(4 * 8, 67) and not fused_pays(60 * 8, 537) and not fused_pays(1 * 8, 537)
