"""FP8 host pages: quantise rows into e4m3 pages with per-token scales, dequantise pages
back; kernel against reference, and both against the float32 values."""

import pytest
import torch

from spin_cluster.kernels.fp8_pages import (
    FP8_DTYPE, retrieve_pages_fp8, retrieve_pages_fp8_ref, write_tokens_fp8, write_tokens_fp8_ref,
)
from spin_cluster.kernels.offload import write_tokens

from .conftest import check_impls

N, S, D = 5, 4, 32


def _pages(device="cpu"):
    k = torch.zeros(N, S, D, dtype=FP8_DTYPE, device=device)
    return k, torch.zeros_like(k), torch.zeros(N, S, device=device), torch.zeros(N, S, device=device)


def _rows(m, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(m, D, generator=g) * torch.logspace(-2, 2, m)[:, None]  # rows of very different scales
    v = torch.randn(m, D, generator=g)
    return k.to(device), v.to(device)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rows_come_back_within_e4m3s_rounding_of_their_largest_value(impl):
    pages = _pages()
    k, v = _rows(6)
    slots = torch.tensor([0, 3, 7, 10, 19, 13])  # flat token slots page * S + offset
    write_tokens_fp8(*pages, k, v, slots, impl=impl)
    out_k, out_v = torch.zeros(N, S, D), torch.zeros(N, S, D)
    ids = torch.arange(N)
    retrieve_pages_fp8(*pages, out_k, out_v, ids, ids, impl=impl)
    # Round to nearest: half an e4m3 step (2^-4 of the value). The interpreter converts fp32
    # to e4m3 its own way (up to 2^-2 seen on tiny rows); on CUDA the kernel's bytes equal the
    # reference's (the gpu test below), so the interpreter's bound only guards the indexing.
    tol = 2.0**-4 if impl == "torch" else 2.0**-2
    for x, out in ((k, out_k), (v, out_v)):
        got = out.view(-1, D)[slots]
        err = (got - x).abs().amax(-1) / x.abs().amax(-1)
        assert bool((err <= tol).all()), err
    # Rows never written stay zero, with zero scales.
    untouched = torch.ones(N * S, dtype=torch.bool)
    untouched[slots] = False
    assert out_k.view(-1, D)[untouched].abs().sum() == 0


def test_a_zero_row_has_scale_one_and_skipped_slots_write_nothing():
    pages = _pages()
    k = torch.zeros(2, D)
    write_tokens_fp8_ref(*pages, k, k.clone(), torch.tensor([1, -1]))
    assert pages[2].view(-1).tolist()[:2] == [0.0, 1.0]
    assert pages[0].view(torch.uint8).sum() == 0


def test_retrieve_skips_pairs_with_a_negative_id():
    pages = _pages()
    k, v = _rows(N * S)
    write_tokens_fp8_ref(*pages, k, v, torch.arange(N * S))
    out_k, out_v = torch.full((3, S, D), 7.0), torch.full((3, S, D), 7.0)
    retrieve_pages_fp8_ref(*pages, out_k, out_v, torch.tensor([4, -1, 2]), torch.tensor([0, 1, -1]))
    assert bool((out_k[1:] == 7).all()) and bool((out_k[0] != 7).any())


def test_write_impls():
    def make():
        k, v = _rows(4, seed=1)
        return (*_pages(), k, v, torch.tensor([2, -1, 5, 17])), {}
    # The interpreter rounds fp32 -> e4m3 differently (by truncation): compare the reference's
    # choices, and the kernel's bytes on CUDA only (test below).
    check_impls(write_tokens_fp8, write_tokens_fp8_ref, make, exact=False,
                outputs=lambda _, args: [args[2], args[3]])  # the scales


def test_retrieve_impls():
    def make():
        pages = _pages()
        k, v = _rows(N * S, seed=2)
        write_tokens_fp8_ref(*pages, k, v, torch.arange(N * S))
        return (*pages, torch.zeros(3, S, D), torch.zeros(3, S, D), torch.tensor([4, 0, -1]), torch.tensor([2, 0, 1])), {}
    check_impls(retrieve_pages_fp8, retrieve_pages_fp8_ref, make, outputs=lambda _, args: [args[4], args[5]])


def test_retrieve_with_several_pairs_per_program(monkeypatch):
    """Programs of 16 pairs (the target lowered to one program), 9 pairs: the pairs past M
    untouched, the reference's pages."""
    import spin_cluster.kernels.retrieve as rt

    monkeypatch.setattr(rt, "_PROGRAMS", 1)

    def make():
        pages = _pages()
        k, v = _rows(N * S, seed=4)
        write_tokens_fp8_ref(*pages, k, v, torch.arange(N * S))
        src = torch.tensor([4, 0, -1, 2, 1, 1, 3, -1, 0])
        return (*pages, torch.zeros(9, S, D), torch.zeros(9, S, D), src, torch.tensor([8, 0, 1, 2, 3, 4, 5, 6, 7])), {}
    assert rt.pairs_per_program(9) == 16
    check_impls(retrieve_pages_fp8, retrieve_pages_fp8_ref, make, outputs=lambda _, args: [args[4], args[5]])


def test_bad_pages_are_refused():
    k, v = _rows(1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        write_tokens_fp8(torch.zeros(N, S, D), torch.zeros(N, S, D), torch.zeros(N, S), torch.zeros(N, S), k, v,
                         torch.tensor([0]))
    pk, pv, ks, _ = _pages()
    with pytest.raises(ValueError, match="scales must be float32"):
        write_tokens_fp8(pk, pv, ks, torch.zeros(N, S + 1), k, v, torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_match_the_reference_bytes_on_cuda_from_pinned_host_pages():
    host = [t.pin_memory() for t in _pages()]
    ref = _pages()
    k, v = _rows(N * S, device="cuda", seed=3)
    slots = torch.randperm(N * S, device="cuda")
    write_tokens_fp8(*host, k, v, slots)  # GPU rows -> pinned host pages, through unified addressing
    torch.cuda.synchronize()
    write_tokens_fp8_ref(*ref, k.cpu(), v.cpu(), slots.cpu())
    assert torch.equal(host[0].view(torch.uint8), ref[0].view(torch.uint8))
    assert torch.equal(host[2], ref[2])
    out = torch.zeros(N, S, D, device="cuda", dtype=torch.bfloat16)
    out_v = torch.zeros_like(out)
    ids = torch.arange(N, device="cuda")
    retrieve_pages_fp8(*host, out, out_v, ids, ids)
    want, want_v = torch.zeros(N, S, D, dtype=torch.bfloat16), torch.zeros(N, S, D, dtype=torch.bfloat16)
    retrieve_pages_fp8_ref(*ref, want, want_v, ids.cpu(), ids.cpu())
    assert torch.equal(out.cpu(), want) and torch.equal(out_v.cpu(), want_v)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_gpu_home_rows_go_unquantised_in_the_same_launch(impl):
    k, v = _rows(5, seed=4)
    host_slots, gpu_slots = torch.tensor([0, -1, 6, -1, -1]), torch.tensor([-1, 2, -1, 9, -1])
    alone, fused = _pages(), _pages()
    write_tokens_fp8(*alone, k, v, host_slots, impl=impl)
    gk, gv = torch.full((3, S, D), 7.0), torch.full((3, S, D), 7.0)
    write_tokens_fp8(*fused, k, v, host_slots, (gk, gv, gpu_slots), impl=impl)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b) for a, b in zip(alone, fused))
    flat_k, flat_v = gk.view(-1, D), gv.view(-1, D)
    assert torch.equal(flat_k[2], k[1]) and torch.equal(flat_v[9], v[3])
    untouched = torch.ones(3 * S, dtype=torch.bool)
    untouched[[2, 9]] = False
    assert bool((flat_k[untouched] == 7).all())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("tail_missed", [True, False], ids=["tail-miss", "tail-hit"])
def test_write_through_rows_land_exact_over_their_dequantised_pages(impl, tail_missed):
    """Retrieve's fused write-through (two heads of 3 selected pages, a row each) equals the
    gather followed by ``write_tokens``: head 0's new row is exact where its tail page (host
    page 2, holding that row quantised) is a miss into slot 5, and where slot 5 holds it
    already; head 1's tail is a hit in slot 7 beside a dead pair naming slot 7."""
    k, v = (x.to(torch.bfloat16) for x in _rows(2, seed=7))
    pages = _pages()
    fill_k, fill_v = _rows(N * S, seed=8)
    write_tokens_fp8_ref(*pages, fill_k, fill_v, torch.arange(N * S))
    slots = torch.tensor([5 * S + 3, 7 * S + 1])
    write_tokens_fp8_ref(*pages, k[:1], v[:1], torch.tensor([2 * S + 3]))  # Offload's host copy of the row
    src = torch.tensor([4, -1, 2 if tail_missed else -1, 0, -1, 3])
    dst = torch.tensor([1, 2, 5 if tail_missed else -1, 0, 7, 4])
    two, fused = ([torch.full((8, S, D), 7.0, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2))
    retrieve_pages_fp8(*pages, *two, src, dst, impl=impl)
    write_tokens(*two, k, v, slots, impl=impl)
    retrieve_pages_fp8(*pages, *fused, src, dst, (k, v, slots), impl=impl)
    assert torch.equal(fused[0], two[0]) and torch.equal(fused[1], two[1])
    flat_k, flat_v = fused[0].view(-1, D), fused[1].view(-1, D)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    host_row = torch.zeros(1, S, D, dtype=torch.bfloat16)
    retrieve_pages_fp8(*pages, host_row, host_row.clone(), torch.tensor([2]), torch.tensor([0]), impl=impl)
    assert not torch.equal(host_row[0, 3], k[0])  # the page's copy over the row would show
