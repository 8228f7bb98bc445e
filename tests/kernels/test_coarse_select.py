"""The two-level Select: the Triton launch gives ``coarse_select_ref``'s pages (integer-valued
queries and bounds, so every score is exact in float32 and ties are real); with every group
kept it is Quest's exact top-k; the coarse rows it reads are the min and max of their pages'
bounds after any append."""

import pytest
import torch

from spin_cluster.kernels import coarse_select as cs
from spin_cluster.kernels.coarse_select import (coarse_candidates, coarse_refresh, coarse_refresh_ref, coarse_select,
                                                coarse_select_ref)
from spin_cluster.kernels.page_select import page_scores_ref, select_ragged_ref

GP = 4  # pages per group


def _index(seed, B=2, hkv=2, G=2, D=16, P=37, nc=24, dtype=torch.float32):
    """Integer-valued queries and page bounds; pages [B, P] rows laid out as the index hands
    them out (each request's groups on consecutive page rows, in an order of its own)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, hkv * G, D), generator=g).float()
    lo = torch.randint(-4, 3, (nc * GP + 1, hkv, D), generator=g).float()
    kmin, kmax = lo.to(dtype), (lo + torch.randint(0, 4, lo.shape, generator=g)).to(dtype)
    kmin[-1], kmax[-1] = float("inf"), float("-inf")  # the dump row
    pg = -(-P // GP)
    pages = torch.empty(B, P, dtype=torch.int64)
    for b in range(B):
        groups = torch.randperm(nc, generator=g)[:pg]
        pages[b] = (groups[:, None] * GP + torch.arange(GP)).flatten()[:P]
    cmin = torch.full((nc + 1, hkv, D), float("inf"), dtype=dtype)
    cmax = torch.full((nc + 1, hkv, D), float("-inf"), dtype=dtype)
    coarse_refresh_ref(kmin, kmax, cmin, cmax, torch.arange(nc), GP)
    return q, kmin, kmax, cmin, cmax, pages


def _both(*args, **kw):
    """The reference against the one launch and the spread launches, these at their own
    programs' widths and at 4 groups and 8 candidates a program (several programs a row, so
    that a row's ranking waits for programs that scored its other parts); the rows' counts
    of finished programs are left zero for the next launch."""
    want = coarse_select_ref(*args, **kw)
    tickets = torch.zeros(2 * want[1].numel() + 3, dtype=torch.int32)
    for split, widths in ((False, None), (True, None), (True, (4, 8))):
        saved = cs._SPREAD_GROUPS, cs._SPREAD_PAGES
        if widths:
            cs._SPREAD_GROUPS, cs._SPREAD_PAGES = widths
        try:
            got = coarse_select(*args, **kw, split=split, tickets=tickets, impl="triton")
        finally:
            cs._SPREAD_GROUPS, cs._SPREAD_PAGES = saved
        assert torch.equal(got[1], want[1]), (split, widths, got[1], want[1])
        assert torch.equal(got[0], want[0]), (split, widths, got[0], want[0])
        assert not tickets.any(), tickets
    return want


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("sink, local", [(1, 2), (0, 1), (3, 0), (20, 20)])
def test_kernel_equals_the_reference(factor, sink, local):
    q, kmin, kmax, cmin, cmax, pages = _index(factor * 10 + sink)
    num_pages = torch.tensor([37, 22])
    budgets = torch.tensor([[5, 9], [0, 30]])
    width = min(37, sink + 30 + local)
    _both(q, kmin, kmax, cmin, cmax, pages, num_pages, sink, local, budgets, width, GP, factor)


def test_hysteresis_and_dense_rows():
    q, kmin, kmax, cmin, cmax, pages = _index(3)
    num_pages = torch.tensor([37, 30])
    budgets = torch.tensor([[4, 7], [6, 3]])
    held = torch.rand(2, 2, 37, generator=torch.Generator().manual_seed(1)) < 0.2
    dense = torch.tensor([False, True])
    want, count = _both(q, kmin, kmax, cmin, cmax, pages, num_pages, 1, 2, budgets, 37, GP, 2,
                        held=held, margin=5.0, dense_rows=dense)
    assert count[1].tolist() == [30, 30]  # the dense request takes every page
    assert torch.equal(want[1, :, :30], torch.arange(30).expand(2, -1))


def test_the_last_group_is_rebuilt_before_it_is_scored():
    # A decode token widened a page of each request's last group after the last refresh.
    q, kmin, kmax, cmin, cmax, pages = _index(13)
    num_pages = torch.tensor([37, 22])
    for b, n in enumerate(num_pages.tolist()):
        kmax[pages[b, n - 1]] += 50
    outs = []
    for impl, split in (("torch", False), ("triton", False), ("triton", True)):
        c = (cmin.clone(), cmax.clone())
        got = coarse_select(q, kmin, kmax, *c, pages, num_pages, 1, 0, torch.tensor([[3, 3], [3, 3]]), 8, GP, 1,
                            split=split, impl=impl)
        outs.append((got, c))
    (want, (a, b)), *rest = outs
    for got, (x, y) in rest:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(x, a) and torch.equal(y, b) and not torch.equal(b, cmax)
    for b_, n in enumerate(num_pages.tolist()):  # local 0: the widened last pages' group wins
        assert set(want[0][b_, :, 1:].flatten().tolist()) - {-1} <= set(range((n - 1) // GP * GP, n))


def test_every_group_kept_is_quests_top_k():
    q, kmin, kmax, cmin, cmax, pages = _index(7)
    num_pages = torch.tensor([37, 33])
    budgets = torch.tensor([[6, 2], [9, 4]])
    exact = select_ragged_ref(page_scores_ref(q, kmin, kmax, pages), num_pages, 1, 2, budgets, 12)
    got = _both(q, kmin, kmax, cmin, cmax, pages, num_pages, 1, 2, budgets, 12, GP, 100)
    assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])


def test_pages_come_only_from_the_best_groups():
    # One group's bounds dominate: a budget of one group's pages at factor 1 takes its pages.
    q, kmin, kmax, cmin, cmax, pages = _index(9, B=1, hkv=1, G=1)
    q = q.abs() + 1
    hot = int(pages[0, 12]) // GP  # group 3 of the request (pages 12..15)
    kmax[hot * GP:(hot + 1) * GP] += 100
    coarse_refresh_ref(kmin, kmax, cmin, cmax, torch.tensor([hot]), GP)
    want, count = _both(q, kmin, kmax, cmin, cmax, pages, torch.tensor([37]), 1, 1, torch.tensor([[4]]), 6, GP, 1)
    assert want[0, 0].tolist() == [0, 12, 13, 14, 15, 36]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refresh_kernel_equals_the_reference(dtype):
    q, kmin, kmax, cmin, cmax, pages = _index(11, dtype=dtype)
    kmin[5 * GP + 1] -= 3  # pages written since the last refresh
    kmax[9 * GP + 2] += 3
    a, b = cmin.clone(), cmax.clone()
    crow = torch.tensor([5, 5, 9, 24, 9])  # runs of one row, the dump row (24), a row again
    coarse_refresh_ref(kmin, kmax, a, b, crow, GP)
    coarse_refresh(kmin, kmax, cmin, cmax, crow, GP, impl="triton")
    assert torch.equal(cmin, a) and torch.equal(cmax, b)
    assert torch.equal(a[5], kmin[5 * GP:6 * GP].amin(0)) and torch.equal(b[9], kmax[9 * GP:10 * GP].amax(0))


def test_candidates_and_bad_arguments():
    assert coarse_candidates(64, 4096, 16, 4) == 256
    assert coarse_candidates(540, 4096, 16, 4) == 2160
    assert coarse_candidates(64, 100, 16, 4) == 112  # every group: 7 of 16 pages
    q, kmin, kmax, cmin, cmax, pages = _index(1)
    with pytest.raises(ValueError, match="power of two"):
        coarse_select_ref(q, kmin, kmax, cmin, cmax, pages, torch.tensor([37, 30]), 1, 1, torch.ones(2, 2, dtype=torch.long),
                          8, 3, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [4, 1])
def test_kernel_equals_the_reference_at_llama_shapes(batch):
    """128K tokens in pages of 32 (4104 pages, decode-width 4608), 8 KV heads of 4 query heads,
    D 128, a bf16 index in groups of 16 pages; S-HPLB-wide budgets up to 540 pages; integer
    values, so both sides' scores are exact; and the refresh kernel against its reference."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    dev, hkv, D, P, n, gp = "cuda", 8, 128, 4608, 4104, 16
    nc = batch * P // gp
    q = torch.randint(-3, 4, (batch, 4 * hkv, D), device=dev, generator=g).to(torch.bfloat16)
    lo = torch.randint(-8, 8, (nc * gp + 1, hkv, D), device=dev, generator=g).float()
    kmin = lo.to(torch.bfloat16)
    kmax = (lo + torch.randint(0, 5, lo.shape, device=dev, generator=g)).to(torch.bfloat16)
    pages = torch.arange(batch * P, device=dev).view(batch, P)
    pages[:, n:] = nc * gp  # past the context: the dump row
    kmin[-1], kmax[-1] = float("inf"), float("-inf")
    cmin = torch.full((nc + 1, hkv, D), float("inf"), dtype=torch.bfloat16, device=dev)
    cmax = torch.full_like(cmin, float("-inf"))
    crow = torch.arange(nc, device=dev).repeat_interleave(3)
    a, b = cmin.clone(), cmax.clone()
    coarse_refresh(kmin, kmax, cmin, cmax, crow, gp)
    coarse_refresh_ref(kmin, kmax, a, b, crow, gp)
    assert torch.equal(cmin, a) and torch.equal(cmax, b)
    budgets = torch.randint(8, 540, (batch, hkv), device=dev, generator=g)
    held = torch.rand(batch, hkv, P, device=dev, generator=g) < 0.1
    num_pages = torch.full((batch,), n, device=dev)
    for factor, margin in ((4, 0.0), (2, 8.0)):
        want = coarse_select_ref(q, kmin, kmax, cmin, cmax, pages, num_pages, 1, 2, budgets, 543, gp, factor,
                                 held, margin)
        for split in (False, True):
            got = coarse_select(q, kmin, kmax, cmin, cmax, pages, num_pages, 1, 2, budgets, 543, gp, factor, held,
                                margin, split=split)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
