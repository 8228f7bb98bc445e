"""Triton body of ``quest_select.py``'s first pass (launcher, checks and reference live there;
the second pass is ``_page_select_kernel._select_merge``)."""

import triton
import triton.language as tl

from ._page_select_kernel import _chunk_candidates, _edges, _quest_query, _quest_scores, _row_budget


# Runtime integers that change from step to step (``_page_select_kernel``'s note).
@triton.jit(do_not_specialize=["stride_pb", "stride_hb", "stride_hh", "P", "KC"])
def _quest_select_local(q_ptr, kmin_ptr, kmax_ptr, pages_ptr, n_ptr, bud_ptr, dense_ptr, held_ptr,
                        x_ptr, cs_ptr, ci_ptr,
                        stride_qb, stride_qh, stride_mn, stride_mh, stride_xn, stride_xh, stride_pb,
                        stride_hb, stride_hh, margin, P, SINK, LOCAL, KC,
                        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                        D_PAD: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
                        KC_PAD: tl.constexpr, HAS_HELD: tl.constexpr, HAS_DENSE: tl.constexpr):
    """One program per (row b * HKV + h, chunk of CHUNK pages)::

        pages  chunk*CHUNK ..                                 .. (chunk+1)*CHUNK - 1
               | BLOCK_P | BLOCK_P | ... |   Quest scores of the middle pages, + margin
                                             where held, into the row's scratch x
               [          CHUNK          ]   read back whole: the chunk's top budget
                                             -> candidates cs/ci [row, chunk, KC]

    Scores are ``_page_scores``' (the same helpers and block shape, so the same float sums);
    sink, local and out-of-context pages are not scored (they are never middle pages)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    n = tl.load(n_ptr + b)
    s_end, l_start = _edges(n, SINK, LOCAL)
    qsum, qabs = _quest_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    first = chunk * CHUNK
    x_row = x_ptr + row.to(tl.int64) * tl.num_programs(1) * CHUNK  # scratch [rows, chunks * CHUNK]
    for i in range(0, CHUNK, BLOCK_P):
        offs_p = first + i + tl.arange(0, BLOCK_P)
        mid = (offs_p >= s_end) & (offs_p < l_start) & (offs_p < P)
        rows = tl.load(pages_ptr + b.to(tl.int64) * stride_pb + offs_p, mask=mid, other=0).to(tl.int64)
        s = _quest_scores(kmin_ptr, kmax_ptr, rows, h, stride_mn, stride_mh, stride_xn, stride_xh, mid,
                          qsum, qabs, D, D_PAD)
        if HAS_HELD:  # hysteresis: every page gains margin or 0.0, as the torch path adds
            held = tl.load(held_ptr + b.to(tl.int64) * stride_hb + h * stride_hh + offs_p, mask=mid, other=0)
            s = s + tl.where(held != 0, margin, 0.0)
        tl.store(x_row + offs_p, s)
    tl.debug_barrier()  # the chunk's scores, stored by other threads of this program, read back
    offs = first + tl.arange(0, CHUNK)
    x = tl.load(x_row + offs)
    valid = (offs >= s_end) & (offs < l_start) & (offs < P) & (x > float("-inf"))
    budget = tl.minimum(tl.minimum(_row_budget(bud_ptr, dense_ptr, row, HKV, HAS_DENSE), KC),
                        tl.sum(valid.to(tl.int32), 0))
    _chunk_candidates(x, valid, budget, offs, cs_ptr, ci_ptr, (row.to(tl.int64) * tl.num_programs(1) + chunk) * KC,
                      KC, CHUNK, KC_PAD)
