"""Triton body of the GPU buffer's lookup (launcher and contract: ``buffer_lookup.py``).

One program per (request row, KV head) of one layer, O(K + C) per head at any share width:
a hit is found through the share's page -> column map (res_col, kept in step with res_page),
not by comparing every selected page with every column. Columns and selected pages go in
chunks of CB and KB, in five passes:

    1 selections  hit column through the map, or a miss
    2 columns     age bucket min(now - last_use, NB - 1) of every column with a slot, counted
                  per bucket; hit columns made unevictable and taken out of the counts
    3 (no walk)   evictable columns in buckets >= j: the cutoff bucket, as the bucketed LRU
    4 columns     victims: older than the cutoff, then the cutoff bucket's first columns
    5 selections  the i-th miss takes the i-th victim; outputs, the share and its map updated

Passes 2 and 4 walk the whole share and run only for a head with a miss: once a share holds its
head's working set (an elastic share may be as wide as the request's pages), a step costs
O(K) per head, not O(C).

One pass's per-column and per-selection state waits for the next in scratch rows
(col_state [C], sel_state [K], rank_col [C]); the step's counters are added atomically.

RESOLVE (``resolve_selected``): the whole of a decode layer's page resolution in this one launch.
Pass 1 also reads each selected page's segment from the directory: a page whose home is on
the GPU (segment >= first_gpu) is read in place (its slot is arithmetic), its segment stamped
for the spill order, and the share never sees it (selection state -3); pass 5 also writes the
misses' host pages (Retrieve's sources), each head's attended length and its newest token's
slot (the lookup epilogue's outputs). That replaced about 25 torch kernels and a second launch
per layer (the directory gather, the tier test, the stamp's scatter, two merges, the epilogue).
"""

import triton
import triton.language as tl


# The layer (0, 1 and 16 were each a variant), the step's stamp and the selection's width are
# runtime integers that change from call to call (``_page_select_kernel``'s note).
@triton.jit(do_not_specialize=["now_val", "layer", "K", "C", "uncounted_row"])
def _buffer_lookup(
    want_ptr, rows_ptr, res_page_ptr, res_slot_ptr, last_use_ptr, res_col_ptr,
    slots_out, miss_dst_out, miss_out, counters_ptr,
    col_state_ptr, sel_state_ptr, rank_col_ptr,
    now_ptr, now_val, layer, stride_row, stride_layer, stride_head,
    col_stride_row, col_stride_layer, col_stride_head,
    K, C, NUM_HEADS,
    dir_ptr, dir_stride_row, dir_stride_layer, dir_stride_head, first_gpu, gpu_slot_offset, gpu_last_use_ptr,
    num_sel_ptr, tail_ptr, src_out, lens_out, tail_slot_out, uncounted_row,
    NUM_BUCKETS: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr, NKC: tl.constexpr, NCC: tl.constexpr,
    NB_PAD: tl.constexpr, REUSE: tl.constexpr, NOW_FROM_PTR: tl.constexpr,
    RESOLVE: tl.constexpr, HOMES: tl.constexpr, SEGMENT_PAGES: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """NKC, NCC: chunk counts (compile-time: a kernel per few shapes, and loop bounds the
    interpreter accepts). RESOLVE: the directory and epilogue arguments are used (else
    ignored); HOMES: some segments are GPU homes (ids >= first_gpu)."""
    pid = tl.program_id(0)
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    row = tl.load(rows_ptr + b).to(tl.int64)
    base = row * stride_row + layer * stride_layer + h * stride_head
    col_base = row * col_stride_row + layer * col_stride_layer + h * col_stride_head
    if NOW_FROM_PTR:
        now = tl.load(now_ptr).to(tl.int32)
    else:
        now = now_val
    kr = tl.arange(0, KB)
    cr = tl.arange(0, CB)
    js = tl.arange(0, NB_PAD)
    want_row = want_ptr + pid * K
    col_state = col_state_ptr + pid.to(tl.int64) * C
    sel_state = sel_state_ptr + pid.to(tl.int64) * K
    rank_col = rank_col_ptr + pid.to(tl.int64) * C
    dir_base = row * dir_stride_row + layer * dir_stride_layer + h * dir_stride_head

    # Pass 1, selections: hit column (through the map), or -2 for a miss, -1 for padding
    # (RESOLVE with HOMES: -3 for a page at home on the GPU, which the share never sees).
    need = 0
    n_valid = 0
    for ki in range(NKC):
        ks = ki * KB + kr
        k_in = ks < K
        w = tl.load(want_row + ks, mask=k_in, other=-1).to(tl.int32)
        valid = w >= 0
        home = valid & (w < 0)  # none: RESOLVE with HOMES finds them
        if RESOLVE and HOMES:
            seg = tl.load(dir_ptr + dir_base + tl.maximum(w, 0) // SEGMENT_PAGES, mask=valid, other=-1)
            home = valid & (seg >= first_gpu)
            tl.store(gpu_last_use_ptr + (seg - first_gpu), tl.full([KB], 0, tl.int32) + now, mask=home)
            valid = valid & ~home
        if REUSE:
            col = tl.load(res_col_ptr + col_base + tl.maximum(w, 0), mask=valid, other=-1).to(tl.int32)
        else:
            col = tl.full([KB], -1, tl.int32)
        hit = valid & (col >= 0)
        miss = valid & ~hit
        need += tl.sum(miss.to(tl.int32), axis=0)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        tl.store(sel_state + ks, tl.where(hit, col, tl.where(miss, -2, tl.where(home, -3, -1))), mask=k_in)
    tl.debug_barrier()

    evicted = need * 0  # a tensor like need: both branches of the if below give one type
    if need > 0:
        # Pass 2, columns: the age bucket of every column with a slot (-1: no slot), counted
        # per bucket; then the hits' columns protected (-1: not evictable) and taken out of
        # the counts. (The counts were a third walk of the columns, a [buckets, CB] tile per
        # chunk: a histogram here and one over the hits cost no walk.)
        per_bucket = tl.zeros([NB_PAD], tl.int32)
        for ci in range(NCC):
            cs = ci * CB + cr
            c_in = cs < C
            slot = tl.load(res_slot_ptr + base + cs, mask=c_in, other=-1)
            last = tl.load(last_use_ptr + base + cs, mask=c_in, other=0)
            bucket = tl.minimum(tl.maximum(now - last, 0), NUM_BUCKETS - 1)
            has = c_in & (slot >= 0)
            per_bucket += tl.histogram(bucket, NB_PAD, mask=has)
            tl.store(col_state + cs, tl.where(has, bucket, -1), mask=c_in)
        tl.debug_barrier()
        for ki in range(NKC):
            ks = ki * KB + kr
            st = tl.load(sel_state + ks, mask=ks < K, other=-1)
            bk = tl.load(col_state + st, mask=st >= 0, other=-1)
            per_bucket -= tl.histogram(tl.maximum(bk, 0), NB_PAD, mask=bk >= 0)
            tl.store(col_state + st, tl.full([KB], -1, tl.int32), mask=st >= 0)
        tl.debug_barrier()

        # Pass 3: how many evictable columns are at least j buckets old; the bucketed LRU's cutoff.
        at_least = tl.sum(per_bucket, axis=0) - tl.cumsum(per_bucket, axis=0) + per_bucket
        take = tl.minimum(need, tl.sum(tl.where(js == 0, at_least, 0), axis=0))
        cut = tl.max(tl.where((at_least >= take) & (js < NUM_BUCKETS), js, -1), axis=0)
        above = tl.sum(tl.where(js == cut + 1, at_least, 0), axis=0)

        # Pass 4, columns in order: victims, and which column the i-th victim is.
        run_cut = 0
        run_victim = 0
        for ci in range(NCC):
            cs = ci * CB + cr
            c_in = cs < C
            bk = tl.load(col_state + cs, mask=c_in, other=-1)
            evictable = bk >= 0
            in_cut = evictable & (bk == cut)
            cut_rank = run_cut + tl.cumsum(in_cut.to(tl.int32), axis=0) - 1
            victim = ((evictable & (bk > cut)) | (in_cut & (cut_rank < take - above))) & (take > 0)
            v_rank = run_victim + tl.cumsum(victim.to(tl.int32), axis=0) - 1
            tl.store(rank_col + v_rank, cs, mask=victim)
            if REUSE:
                page = tl.load(res_page_ptr + base + cs, mask=c_in, other=-1)
                evicted += tl.sum((victim & (page >= 0)).to(tl.int32), axis=0)
            run_cut += tl.sum(in_cut.to(tl.int32), axis=0)
            run_victim += tl.sum(victim.to(tl.int32), axis=0)
        tl.debug_barrier()
    if not REUSE:  # the share forgets what it held: only this step's misses stay
        for ci in range(NCC):
            cs = ci * CB + cr
            tl.store(res_page_ptr + base + cs, tl.full([CB], -1, tl.int32), mask=cs < C)
        tl.debug_barrier()

    # Pass 5, selections in order: the i-th miss takes the i-th victim; outputs, the share
    # and its map updated (a victim's old page is never selected: it would have been a hit).
    run_miss = 0
    if RESOLVE:
        n_sel = tl.load(num_sel_ptr + pid).to(tl.int32)
        tail = tl.load(tail_ptr + b).to(tl.int32)
        tail_slot = (n_sel * 0).to(tl.int64)
    for ki in range(NKC):
        ks = ki * KB + kr
        k_in = ks < K
        st = tl.load(sel_state + ks, mask=k_in, other=-1)
        w = tl.load(want_row + ks, mask=k_in, other=-1).to(tl.int32)
        valid = (st >= 0) | (st == -2)  # the share's selections (not padding, not GPU homes)
        hit = st >= 0
        miss = st == -2
        m_rank = run_miss + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        miss_col = tl.load(rank_col + m_rank, mask=miss, other=0)
        col = tl.where(hit, st, tl.where(miss, miss_col, 0))
        col = tl.minimum(tl.maximum(col, 0), C - 1)
        got = tl.load(res_slot_ptr + base + col, mask=k_in, other=0)
        out = tl.where(valid, got, 0)
        if RESOLVE:
            # Home page ids (homes.py): segment * E + page within it; a GPU home's slot is that
            # plus gpu_slot_offset. Misses' pages are Retrieve's sources.
            home = st == -3
            safe = tl.maximum(w, 0)
            seg = tl.load(dir_ptr + dir_base + safe // SEGMENT_PAGES, mask=miss | home, other=0).to(tl.int64)
            page = seg * SEGMENT_PAGES + safe % SEGMENT_PAGES
            out = tl.where(home, (page + gpu_slot_offset).to(tl.int32), out)
            tl.store(src_out + pid * K + ks, tl.where(miss, page, -1), mask=k_in)
            tail_slot += tl.sum(tl.where(ks == tl.maximum(n_sel - 1, 0), out, 0).to(tl.int64), axis=0)
        tl.store(slots_out + pid * K + ks, out, mask=k_in)
        tl.store(miss_dst_out + pid * K + ks, tl.where(miss, got.to(tl.int64), -1), mask=k_in)
        tl.store(miss_out + pid * K + ks, miss.to(tl.int8), mask=k_in)
        if REUSE:
            old = tl.load(res_page_ptr + base + col, mask=k_in & miss, other=-1)
            tl.store(res_col_ptr + col_base + tl.maximum(old, 0), tl.full([KB], -1, tl.int32), mask=miss & (old >= 0))
            tl.store(res_col_ptr + col_base + tl.maximum(w, 0), col, mask=k_in & miss)
        tl.store(res_page_ptr + base + col, w, mask=k_in & miss)
        tl.store(last_use_ptr + base + col, tl.full([KB], 0, tl.int32) + now, mask=k_in & valid)
        run_miss += tl.sum(miss.to(tl.int32), axis=0)
    if RESOLVE:
        tl.store(lens_out + pid, (n_sel - 1) * PAGE_SIZE + tail)
        tl.store(tail_slot_out + pid, tail_slot * PAGE_SIZE + (tail - 1))
    if row != uncounted_row:  # (a padding row's lookups are not the step's)
        tl.atomic_add(counters_ptr + 0, n_valid.to(tl.int64))
        tl.atomic_add(counters_ptr + 1, (n_valid - need).to(tl.int64))
        tl.atomic_add(counters_ptr + 2, need.to(tl.int64))
        tl.atomic_add(counters_ptr + 3, evicted.to(tl.int64))


@triton.jit(do_not_specialize=["layer", "num_pages"])
def _resident_pages(
    res_col_ptr, rows_ptr, dir_ptr, out_ptr,
    layer, num_pages, col_stride_row, col_stride_layer, col_stride_head,
    dir_stride_row, dir_stride_layer, dir_stride_head, first_gpu, NUM_HEADS,
    HOMES: tl.constexpr, SEGMENT_PAGES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Which pages a step reads without a transfer (``resident_pages``): program (b * H + h,
    block of BLOCK pages)."""
    pid = tl.program_id(0)
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    row = tl.load(rows_ptr + b).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p_in = p < num_pages
    col = tl.load(res_col_ptr + row * col_stride_row + layer * col_stride_layer + h * col_stride_head + p,
                  mask=p_in, other=-1)
    held = col >= 0
    if HOMES:
        seg = tl.load(dir_ptr + row * dir_stride_row + layer * dir_stride_layer + h * dir_stride_head
                      + p // SEGMENT_PAGES, mask=p_in, other=-1)
        held = held | (seg >= first_gpu)
    tl.store(out_ptr + pid.to(tl.int64) * num_pages + p, held.to(tl.int8), mask=p_in)
