"""Triton body of Quest's index append (launcher and contract: ``index_append.py``).

One program per (token, KV head). Tokens of one scoring block sit next to each other in a
step (a request's tokens are contiguous and ascending), so the first token of each run of
one block leads it: it starts from the block's stored bounds (or empty bounds when the run
begins the block), folds in up to BLK tokens of its run, and stores once. The other
programs of the run return at once: no two programs write one block, so no atomics.
"""

import triton
import triton.language as tl

from ._layer_ops_kernel import _round_to


@triton.jit(do_not_specialize=["T"])  # the step's token count: one compile for every step
def _bounds_append(
    kmin_ptr, kmax_ptr, k_ptr, block_ptr, pos_ptr, T,
    stride_kt, stride_kh, stride_ib, stride_ih,
    BLK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SLACK: tl.constexpr,
):
    """SLACK: relative margin for a 16-bit index (bounds rounded outward), 0.0 for float32."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(block_ptr + t)
    prev = tl.load(block_ptr + tl.maximum(t - 1, 0))
    if (t == 0) | (prev != blk):
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        at = blk.to(tl.int64) * stride_ib + h * stride_ih + d
        fresh = (pos % BLK) == 0
        lo = tl.load(kmin_ptr + at, mask=m & ~fresh, other=float("inf")).to(tl.float32)
        hi = tl.load(kmax_ptr + at, mask=m & ~fresh, other=float("-inf")).to(tl.float32)
        for j in range(BLK):
            tt = t + j
            ok = tt < T
            same = tl.load(block_ptr + tl.minimum(tt, T - 1)) == blk
            take = ok & same
            k = tl.load(k_ptr + tl.minimum(tt, T - 1).to(tl.int64) * stride_kt + h * stride_kh + d,
                        mask=m & take, other=0.0).to(tl.float32)
            slack = tl.abs(k) * SLACK
            klo = _round_to(k - slack, kmin_ptr.dtype.element_ty)  # nearest, as torch's .to()
            khi = _round_to(k + slack, kmax_ptr.dtype.element_ty)
            lo = tl.where(take, tl.minimum(lo, klo), lo)
            hi = tl.where(take, tl.maximum(hi, khi), hi)
        tl.store(kmin_ptr + at, lo.to(kmin_ptr.dtype.element_ty), mask=m)
        tl.store(kmax_ptr + at, hi.to(kmax_ptr.dtype.element_ty), mask=m)
