"""Quest's index append kernel (under TRITON_INTERPRET=1 on the CPU) against its torch
reference: decode tokens (one per request), prefill runs over several blocks, blocks begun
in an earlier step, fresh blocks over an earlier owner's bounds, 16-bit outward rounding."""

import pytest
import torch

from spin_cluster.kernels.index_append import bounds_append, bounds_append_planned, bounds_append_ref, plan_bounds_append

from .conftest import check_impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(runs, H, D, blk, n_rows, dtype, seed):
    """runs: (flat block row of the run's first token, its first position, tokens) per request;
    bounds start from an earlier owner's random values."""
    g = torch.Generator().manual_seed(seed)
    blocks, positions = [], []
    for first_block, first_pos, n in runs:
        pos = torch.arange(first_pos, first_pos + n)
        positions.append(pos)
        blocks.append(first_block + pos // blk - first_pos // blk)
    blocks, positions = torch.cat(blocks), torch.cat(positions)
    k = torch.randn(blocks.shape[0], H, D, generator=g).to(dtype if dtype != torch.float32 else torch.float32)
    old = torch.randn(n_rows, H, D, generator=g)
    kmin, kmax = (old - 1).to(dtype), (old + 1).to(dtype)
    return [t.to(DEVICE) for t in (kmin, kmax, k, blocks, positions)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs", [
    [(3, 16, 1), (9, 37, 1), (20, 5, 1)],  # decode: one token per request, fresh and begun blocks
    [(0, 0, 19), (12, 6, 11)],  # prefill: a run from position 0, one from the middle of a block
    [(4, 7, 1), (30, 0, 8), (40, 3, 13)],  # a mixed step
])
def test_kernel_equals_reference(runs, dtype):
    blk = 8
    args = _case(runs, H=2, D=12, blk=blk, n_rows=64, dtype=dtype, seed=len(runs))
    ref = [t.clone() for t in args[:2]]
    bounds_append(*args, blk, impl="triton")
    bounds_append_ref(*ref, *args[2:], blk)
    # The reference parks its resets of non-first tokens in the last row (a dump row): the rest agrees.
    assert torch.equal(args[0][:-1], ref[0][:-1]) and torch.equal(args[1][:-1], ref[1][:-1])
    assert not torch.equal(args[0][:-1], _case(runs, 2, 12, blk, 64, dtype, len(runs))[0][:-1])  # it wrote


def test_bounds_hold_every_key_of_the_block_and_forget_an_earlier_owner():
    blk = 4
    kmin, kmax, k, blocks, positions = _case([(2, 0, 6)], H=1, D=8, blk=blk, n_rows=8, dtype=torch.bfloat16, seed=0)
    untouched = kmin[5].clone()
    bounds_append(kmin, kmax, k, blocks, positions, blk, impl="triton")
    for b, keys in ((2, k[:4]), (3, k[4:6])):  # both blocks start fresh (positions 0 and 4)
        assert (kmin[b].float() <= keys.float().amin(0)).all() and (kmax[b].float() >= keys.float().amax(0)).all()
        # rounded outward by at most the slack: as tight as 16 bits allow
        assert (kmin[b].float() >= keys.float().amin(0) - keys.float().abs().amax(0) * 2**-6).all()
    assert torch.equal(kmin[5], untouched)


def test_impl_choice():
    blk = 8
    check_impls(bounds_append, bounds_append_ref,
                lambda: ([*_case([(3, 16, 1), (0, 0, 11)], H=2, D=12, blk=blk, n_rows=16, dtype=torch.float32, seed=1),
                          blk], {}),
                outputs=lambda _, args: [t[:-1] for t in args[:2]])  # not the reference's dump row


def test_planned_append_equals_bounds_append():
    # Planned once per step, the choice fixed then: each plan's append equals the unplanned one.
    blk = 8
    for impl in ("triton", "torch"):
        kmin, kmax, k, blocks, positions = _case([(3, 16, 1), (0, 0, 11)], H=2, D=12, blk=blk, n_rows=16,
                                                 dtype=torch.bfloat16, seed=2)
        ref = [kmin.clone(), kmax.clone()]
        plan = plan_bounds_append(blocks, positions, blk, kmin.shape[0], kmin.shape[1:], impl=impl)
        assert plan.impl == impl
        bounds_append_planned(kmin, kmax, k, plan)
        bounds_append_ref(*ref, k, blocks, positions, blk)
        assert torch.equal(kmin[:-1], ref[0][:-1]) and torch.equal(kmax[:-1], ref[1][:-1])
    with pytest.raises(ValueError, match="impl"):
        plan_bounds_append(blocks, positions, blk, kmin.shape[0], kmin.shape[1:], impl="cpu")
