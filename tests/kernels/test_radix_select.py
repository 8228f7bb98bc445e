"""The many-program radix Select gives ``select_ragged_ref``'s pages, counts and order: ties
within and across chunks, keys that share the first digit, -inf runs, empty and overfull
budgets, sink and local windows that overlap."""

import pytest
import torch

from spin_cluster.kernels.page_select import select_ragged_ref
from spin_cluster.kernels.radix_select import select_ragged_radix

from .test_page_select import _select_case as _case  # rows of 70 pages: ties, -inf runs, overfull budgets


def _check(scores, num_pages, sink, local, budgets, width, chunk=16):
    want = select_ragged_ref(scores, num_pages, sink, local, budgets, width)
    for fused in (False, True):  # four launches, and passes 2-4 in one
        got = select_ragged_radix(scores, num_pages, sink, local, budgets, width, chunk=chunk, fused=fused,
                                  impl="triton")
        assert torch.equal(got[1], want[1]), (fused, got[1], want[1])
        assert torch.equal(got[0], want[0]), (fused, got[0], want[0])


@pytest.mark.parametrize("sink, local", [(1, 4), (0, 1), (2, 0), (40, 40)])
@pytest.mark.parametrize("seed", [5, 6])
def test_radix_select_equals_the_reference(sink, local, seed):
    scores, num_pages, budgets = _case(seed)
    _check(scores, num_pages, sink, local, budgets, min(70, sink + 12 + local))


def test_ties_across_chunks_take_the_lowest_pages():
    # Every middle score equal: the budget takes the first pages, wherever the chunks end.
    scores = torch.full((1, 2, 100), 0.5)
    scores[0, 1, ::3] = 0.25
    budgets = torch.tensor([[37, 41]])
    _check(scores, torch.tensor([100]), 1, 2, budgets, 1 + 41 + 2)


def test_keys_that_share_the_first_digit():
    # 1 + small steps: one exponent and the same top mantissa bits, so every key is a
    # candidate and the low digits decide; some steps tie.
    g = torch.Generator().manual_seed(2)
    steps = torch.randint(0, 50, (2, 3, 90), generator=g).float()
    scores = 1.0 + steps * 2.0 ** -20
    budgets = torch.tensor([[5, 17, 0], [1, 60, 90]])
    _check(scores, torch.tensor([90, 64]), 2, 3, budgets, 2 + 90 + 3)


def test_signs_zeros_and_infinities():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(2, 1, 80, generator=g) * 1e3
    scores[0, 0, 5:25] = float("-inf")
    scores[1, 0, 30] = float("inf")
    scores[1, 0, 40:44] = -0.0
    scores[1, 0, 44:48] = 0.0
    budgets = torch.tensor([[30], [50]])
    _check(scores, torch.tensor([80, 80]), 1, 1, budgets, 52)
    _check(scores, torch.tensor([80, 80]), 1, 1, budgets, 52, chunk=32)


def test_rows_longer_than_one_program_would_hold_at_once():
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 2, 600, generator=g).round(decimals=2)
    budgets = torch.tensor([[70, 300]])
    _check(scores, torch.tensor([590]), 1, 2, budgets, 1 + 300 + 2, chunk=64)


def test_bad_chunk_raises():
    scores, num_pages, budgets = _case(5)
    with pytest.raises(ValueError, match="chunk"):
        select_ragged_radix(scores, num_pages, 1, 1, budgets, 14, chunk=24, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_size_radix_select_on_gpu():
    """128K tokens of 32-token pages at batch 4 and one 128K request of 16-token pages, with
    S-HPLB-wide budgets and ties."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    for B, P in ((4, 4160), (1, 8208)):
        scores = torch.randn(B, 8, P, generator=g, device=dev).round(decimals=2)
        budgets = torch.randint(0, 541, (B, 8), generator=g, device=dev)
        num_pages = torch.full((B,), P - 3, device=dev)
        want = select_ragged_ref(scores, num_pages, 1, 2, budgets, 543)
        for fused in (False, True):
            got = select_ragged_radix(scores, num_pages, 1, 2, budgets, 543, fused=fused, impl="triton")
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), fused
