"""Triton bodies of the FP8 host page kernels (launchers and contract: ``fp8_pages.py``).

``_write_tokens_fp8``: grid (M,), one program per K/V row: its scale (max |x| / 448), the
row quantised to e4m3 and stored as bytes, the scale beside it. ``_retrieve_pages_fp8``:
grid (cdiv(M, PAIRS),), a program per PAIRS page pairs (``retrieve.py``'s ``pairs_per_program``),
each live pair's FP8 page and its scales read (from pinned host memory where the source is
there), the page dequantised into the destination's dtype; with ``ROWS``, R row programs
first and each page carrying its group's write-through row, exact in place of the host's
quantised one, as ``_retrieve_kernel.py``'s ``_retrieve_pages`` does.
"""

import triton
import triton.language as tl

from ._retrieve_kernel import _pair_value, _pairs_and_rows, _write_row_unless_copied


@triton.jit
def _quantise_row(src, dst, dst_scale, slot, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # Correctly rounded divisions (Triton's fp32 '/' is approximate): the reference's scale
    # and bytes exactly.
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv)
    tl.store(dst + slot * D + offs, q.to(tl.uint8, bitcast=True), mask=m)
    tl.store(dst_scale + slot, scale)

@triton.jit
def _write_tokens_fp8(dk, dv, dks, dvs, k, v, slots, stride_k, stride_v, ak, av, also_slots,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, ALSO: tl.constexpr):
    # int64: a spill of a long chunk writes over 2^31 / D rows, and i * stride_k must not wrap.
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + i).to(tl.int64)
    if slot >= 0:
        _quantise_row(k + i * stride_k, dk, dks, slot, D, BLOCK_D)
        _quantise_row(v + i * stride_v, dv, dvs, slot, D, BLOCK_D)
    if ALSO:  # the same rows, unquantised, to a second destination (the GPU home pages)
        slot = tl.load(also_slots + i).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK_D)
            m = offs < D
            tl.store(ak + slot * D + offs, tl.load(k + i * stride_k + offs, mask=m), mask=m)
            tl.store(av + slot * D + offs, tl.load(v + i * stride_v + offs, mask=m), mask=m)

@triton.jit
def _dequantise_page(pages, scales, out, src, dst, row_ptr, row_off, S: tl.constexpr, D: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Page src -> page dst of out; with ROWS and row_off >= 0, row row_off from row_ptr instead."""
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < S)[:, None] & (cols < D)[None, :]
    at = rows[:, None] * D + cols[None, :]
    q = tl.load(pages + src * S * D + at, mask=m, other=0).to(tl.float8e4nv, bitcast=True)
    scale = tl.load(scales + src * S + rows, mask=rows < S, other=0.0)
    x = (q.to(tl.float32) * scale[:, None]).to(out.dtype.element_ty)
    if ROWS:
        if row_off >= 0:
            new = tl.load(row_ptr + cols, mask=cols < D)
            x = tl.where((rows == row_off)[:, None], new[None, :], x)
    tl.store(out + dst * S * D + at, x, mask=m)

@triton.jit
def _retrieve_pages_fp8(sk, sv, sks, svs, dk, dv, src_ids, dst_ids, M, k_rows, v_rows, row_slots, stride_rk,
                        stride_rv, group, num_rows, S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
                        GROUP_CHUNKS: tl.constexpr):
    """Pairs p * PAIRS .. p * PAIRS + PAIRS - 1 of M, one after another (``retrieve.py``'s
    ``pairs_per_program``: few programs where most pairs are dead), after R row programs with
    ROWS (``_retrieve_kernel.py``)."""
    pid = tl.program_id(0)
    if pid >= num_rows:
        js, srcs, dsts, lives, rows, row_offs = _pairs_and_rows(src_ids, dst_ids, row_slots, M, pid - num_rows, group,
                                                                S, PAIRS, ROWS)
        for j in tl.static_range(PAIRS):
            if _pair_value(js, j, lives.to(tl.int32)) > 0:
                src = _pair_value(js, j, srcs)
                dst = _pair_value(js, j, dsts)
                row = _pair_value(js, j, rows)
                row_off = _pair_value(js, j, row_offs)
                _dequantise_page(sk, sks, dk, src, dst, k_rows + row * stride_rk, row_off, S, D, BLOCK_S, BLOCK_D,
                                 ROWS)
                _dequantise_page(sv, svs, dv, src, dst, v_rows + row * stride_rv, row_off, S, D, BLOCK_S, BLOCK_D,
                                 ROWS)
    elif ROWS:
        _write_row_unless_copied(k_rows, v_rows, row_slots, stride_rk, stride_rv, dk, dv, S * D, S * D, src_ids,
                                 dst_ids, M, group, pid, S, D, BLOCK_D, BLOCK_G, GROUP_CHUNKS)
