"""Triton body of the GPU buffer's lookup (launcher and contract: ``buffer_lookup.py``).

One program per (request row, KV head) of one layer. A head's share of C columns and its K
selected pages fit in registers, so every step of the lookup is a [K, C] or [NB, C] tile:

    match      want[k] == res_page[c]            hits, hit columns, protected columns
    buckets    min(now - last_use, NB - 1)        of the evictable columns
    at_least   evictable columns in buckets >= j  the cutoff bucket, as the bucketed LRU
    victims    older than the cutoff, then the cutoff bucket's first columns (a prefix sum)
    misses     the i-th miss takes the i-th victim column (two prefix sums and a [K, C] match)

then the share is updated in place (misses hold their page, selected columns were used now)
and the step's counters are added atomically.
"""

import triton
import triton.language as tl


@triton.jit
def _buffer_lookup(
    want_ptr, rows_ptr, res_page_ptr, res_slot_ptr, last_use_ptr,
    slots_out, miss_dst_out, miss_out, counters_ptr,
    now_ptr, now_val, layer, stride_row, stride_layer, stride_head,
    K, C, NUM_HEADS,
    NUM_BUCKETS: tl.constexpr, K_PAD: tl.constexpr, C_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    REUSE: tl.constexpr, NOW_FROM_PTR: tl.constexpr,
):
    pid = tl.program_id(0)  # b * NUM_HEADS + h
    # The step index: a launch argument, or read from the device (a CUDA graph replays its
    # launches with the arguments they were captured with).
    if NOW_FROM_PTR:
        now = tl.load(now_ptr).to(tl.int32)
    else:
        now = now_val
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    row = tl.load(rows_ptr + b).to(tl.int64)
    base = row * stride_row + layer * stride_layer + h * stride_head

    ks = tl.arange(0, K_PAD)
    cs = tl.arange(0, C_PAD)
    k_in = ks < K
    c_in = cs < C
    want = tl.load(want_ptr + pid * K + ks, mask=k_in, other=-1)
    valid = want >= 0
    page = tl.load(res_page_ptr + base + cs, mask=c_in, other=-1)
    if not REUSE:
        page = tl.full([C_PAD], -1, tl.int32)
    slot = tl.load(res_slot_ptr + base + cs, mask=c_in, other=-1)
    last = tl.load(last_use_ptr + base + cs, mask=c_in, other=0)

    # Hits: a selected page already held by a column of the share.
    match = (want[:, None] == page[None, :]) & valid[:, None] & c_in[None, :]  # [K, C]
    hit = tl.max(match.to(tl.int32), axis=1) > 0
    hit_col = tl.min(tl.where(match, cs[None, :], C_PAD), axis=1)
    miss = valid & ~hit
    protected = tl.max(match.to(tl.int32), axis=0) > 0  # [C] columns selected this step
    evictable = (slot >= 0) & ~protected & c_in

    # Bucketed LRU over the evictable columns (the rule of spin_cluster.kvcache.lru).
    age = tl.maximum(now - last, 0)
    bucket = tl.minimum(age, NUM_BUCKETS - 1)
    need = tl.sum(miss.to(tl.int32), axis=0)
    js = tl.arange(0, NB_PAD)
    at_least = tl.sum(((bucket[None, :] >= js[:, None]) & evictable[None, :]).to(tl.int32), axis=1)  # [NB]
    take = tl.minimum(need, tl.sum(evictable.to(tl.int32), axis=0))
    cut = tl.max(tl.where((at_least >= take) & (js < NUM_BUCKETS), js, -1), axis=0)
    above = tl.sum(tl.where(js == cut + 1, at_least, 0), axis=0)  # evictable in buckets > cut
    in_cut = evictable & (bucket == cut)
    cut_rank = tl.cumsum(in_cut.to(tl.int32), axis=0) - 1
    victim = (evictable & (bucket > cut)) | (in_cut & (cut_rank < take - above))
    victim = victim & (take > 0)

    # The i-th miss (in selection order) takes the i-th victim (in column order).
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    victim_rank = tl.cumsum(victim.to(tl.int32), axis=0) - 1
    pair = (miss_rank[:, None] == victim_rank[None, :]) & victim[None, :] & miss[:, None]  # [K, C]
    miss_col = tl.min(tl.where(pair, cs[None, :], C_PAD), axis=1)
    col = tl.where(hit, hit_col, tl.where(miss, miss_col, 0))
    col = tl.minimum(col, C - 1)
    got = tl.load(res_slot_ptr + base + col, mask=k_in, other=0)

    tl.store(slots_out + pid * K + ks, tl.where(valid, got, 0), mask=k_in)
    tl.store(miss_dst_out + pid * K + ks, tl.where(miss, got.to(tl.int64), -1), mask=k_in)
    tl.store(miss_out + pid * K + ks, miss.to(tl.int8), mask=k_in)
    evicted = tl.sum((victim & (page >= 0)).to(tl.int64), axis=0)
    # Update the share: misses now hold their page; every selected column was used now.
    tl.debug_barrier()
    if not REUSE:  # the share forgets what it held: only this step's misses stay
        tl.store(res_page_ptr + base + cs, page, mask=c_in)
        tl.debug_barrier()
    tl.store(res_page_ptr + base + col, want, mask=k_in & miss)
    tl.store(last_use_ptr + base + col, tl.full([K_PAD], 0, tl.int32) + now, mask=k_in & valid)
    tl.atomic_add(counters_ptr + 0, tl.sum(valid.to(tl.int64), axis=0))
    tl.atomic_add(counters_ptr + 1, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counters_ptr + 2, tl.sum(miss.to(tl.int64), axis=0))
    tl.atomic_add(counters_ptr + 3, evicted)
