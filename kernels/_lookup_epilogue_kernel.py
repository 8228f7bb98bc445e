"""Triton body of the lookup epilogue (launcher and contract: ``lookup_epilogue.py``)."""

import triton
import triton.language as tl


# The layer and the selection's width change from call to call (``_page_select_kernel``'s note).
@triton.jit(do_not_specialize=["layer", "K"])
def _lookup_epilogue(
    want_ptr, slots_ptr, miss_ptr, num_sel_ptr, rows_ptr, tail_ptr, dir_ptr,
    src_out, lens_out, tail_slot_out,
    layer, stride_row, stride_layer, stride_head, K, NUM_HEADS,
    SEGMENT_PAGES: tl.constexpr, PAGE_SIZE: tl.constexpr, K_PAD: tl.constexpr,
):
    pid = tl.program_id(0)  # b * NUM_HEADS + h
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    row = tl.load(rows_ptr + b).to(tl.int64)
    ks = tl.arange(0, K_PAD)
    k_in = ks < K
    want = tl.load(want_ptr + pid * K + ks, mask=k_in, other=-1).to(tl.int64)
    miss = tl.load(miss_ptr + pid * K + ks, mask=k_in, other=0) != 0
    fetch = miss & (want >= 0)
    safe = tl.maximum(want, 0)
    seg = tl.load(dir_ptr + row * stride_row + layer * stride_layer + h * stride_head + safe // SEGMENT_PAGES,
                  mask=fetch, other=0).to(tl.int64)
    tl.store(src_out + pid * K + ks, tl.where(fetch, seg * SEGMENT_PAGES + safe % SEGMENT_PAGES, -1), mask=k_in)
    n = tl.load(num_sel_ptr + pid).to(tl.int32)
    tail = tl.load(tail_ptr + b).to(tl.int32)
    tl.store(lens_out + pid, (n - 1) * PAGE_SIZE + tail)
    slots = tl.load(slots_ptr + pid * K + ks, mask=k_in, other=0)
    last = tl.maximum(n - 1, 0)
    tail_slot = tl.sum(tl.where(ks == last, slots, 0), axis=0).to(tl.int64)
    tl.store(tail_slot_out + pid, tail_slot * PAGE_SIZE + (tail - 1))
