"""Triton bodies of bucketed LRU victim selection (see ``lru_kernel.py`` for the launcher).

Importing this module needs Triton. ``lru_kernel.py`` imports it lazily, so the pure-torch
reference works without Triton.

Three launches, each a fixed grid; slots are cut into blocks of ``BLOCK`` columns::

    row b:  | block 0 | block 1 | ... | block nblk-1 |        last_use, evictable [B, N]

``_lru_block_hist``  grid (nblk, B)
    Per block, a histogram of the evictable slots' buckets -> ``block_hist [B, nblk, NB_PAD]``.
    The histogram stays in the program (no global atomics: a million slots in 64 bins would
    serialise on the oldest bin).
``_lru_cutoff``      grid (B,)
    Sums its row's block histograms, finds the cutoff bucket ``c`` and how many slots
    ``take_in_cut`` it gives (see the reference for the rule), writes ``num_victims``, and
    for every block the number of bucket-``c`` evictable slots in the blocks before it
    (``block_off [B, nblk]``, an exclusive prefix sum over blocks).
``_lru_mark``        grid (nblk, B)
    Recomputes the buckets of its block, ranks the bucket-``c`` slots by column
    (``block_off`` + an in-block prefix sum) and writes the victim mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_row_value(ptr, val, row, stride, FROM_PTR: tl.constexpr):
    """A per-row integer given either as a tensor (stride 0 broadcasts) or as a scalar."""
    if FROM_PTR:
        return tl.load(ptr + row * stride).to(tl.int64)
    else:
        return val + tl.zeros([], dtype=tl.int64)  # val may be specialised to a constant


@triton.jit
def _block_buckets(
    last_use_ptr, evictable_ptr, row, cols, n, stride_lu, stride_ev, now,
    SPAN: tl.constexpr, WIDTH: tl.constexpr,
):
    """Bucket [BLOCK] int32 and evictable [BLOCK] bool (False past the row's end)."""
    in_row = cols < n
    lu = tl.load(last_use_ptr + row * stride_lu + cols, mask=in_row, other=0).to(tl.int64)
    ev = tl.load(evictable_ptr + row * stride_ev + cols, mask=in_row, other=0)
    age = tl.maximum(now - lu, 0)
    bucket = (tl.minimum(age, SPAN) // WIDTH).to(tl.int32)
    return bucket, in_row & (ev != 0)


@triton.jit
def _lru_block_hist(
    last_use_ptr,
    evictable_ptr,  # uint8 view of the bool mask
    now_ptr,
    now_val,
    hist_ptr,  # [B, nblk, NB_PAD] int32
    n,
    stride_lu,
    stride_ev,
    stride_now,
    NUM_BLOCKS: tl.constexpr,
    NB_PAD: tl.constexpr,
    SPAN: tl.constexpr,  # num_buckets * bucket_width - 1
    WIDTH: tl.constexpr,
    NOW_FROM_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    now = _load_row_value(now_ptr, now_val, row, stride_now, NOW_FROM_PTR)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    bucket, evictable = _block_buckets(
        last_use_ptr, evictable_ptr, row, cols, n, stride_lu, stride_ev, now, SPAN, WIDTH
    )
    hist = tl.histogram(bucket, NB_PAD, mask=evictable)  # [NB_PAD]
    tl.store(hist_ptr + (row * NUM_BLOCKS + blk) * NB_PAD + tl.arange(0, NB_PAD), hist)


@triton.jit
def _lru_cutoff(
    hist_ptr,  # [B, nblk, NB_PAD] int32
    need_ptr,
    need_val,
    stride_need,
    block_off_ptr,  # [B, nblk] int32
    cut_ptr,  # [B, 2] int64: cutoff bucket, victims taken from it
    num_victims_ptr,  # [B] int64
    NUM_BLOCKS: tl.constexpr,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    NEED_FROM_PTR: tl.constexpr,
    BLOCKS_PER_ITER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    buckets = tl.arange(0, NB_PAD)
    blks = tl.arange(0, BLOCKS_PER_ITER)
    row_hist = hist_ptr + row * NUM_BLOCKS * NB_PAD

    counts = tl.zeros([NB_PAD], dtype=tl.int32)
    for start in range(0, NUM_BLOCKS, BLOCKS_PER_ITER):
        b = start + blks
        tile = tl.load(
            row_hist + b[:, None] * NB_PAD + buckets[None, :],
            mask=(b < NUM_BLOCKS)[:, None],
            other=0,
        )  # [BLOCKS_PER_ITER, NB_PAD]
        counts += tl.sum(tile, axis=0)

    at_least = tl.cumsum(counts, axis=0, reverse=True)  # [NB_PAD] evictable in buckets >= j
    total = tl.sum(counts).to(tl.int64)
    need = _load_row_value(need_ptr, need_val, row, stride_need, NEED_FROM_PTR)
    take = tl.minimum(tl.maximum(need, 0), total)
    # at_least is non-increasing and at_least[0] = total >= take: {j : at_least[j] >= take}
    # is a prefix 0..c of the real buckets.
    cut = tl.sum(((buckets < NB) & (at_least >= take)).to(tl.int32)) - 1
    older = tl.sum(tl.where(buckets > cut, counts, 0)).to(tl.int64)
    tl.store(cut_ptr + row * 2, cut.to(tl.int64))
    tl.store(cut_ptr + row * 2 + 1, take - older)
    tl.store(num_victims_ptr + row, take)

    carry = tl.zeros([], dtype=tl.int32)
    for start in range(0, NUM_BLOCKS, BLOCKS_PER_ITER):
        b = start + blks
        in_range = b < NUM_BLOCKS
        c = tl.load(row_hist + b * NB_PAD + cut, mask=in_range, other=0)  # [BLOCKS_PER_ITER]
        before = carry + tl.cumsum(c, axis=0) - c
        tl.store(block_off_ptr + row * NUM_BLOCKS + b, before, mask=in_range)
        carry += tl.sum(c)


@triton.jit
def _lru_mark(
    last_use_ptr,
    evictable_ptr,
    now_ptr,
    now_val,
    block_off_ptr,
    cut_ptr,
    out_ptr,  # [B, N] uint8 view of the bool victim mask, contiguous
    n,
    stride_lu,
    stride_ev,
    stride_now,
    NUM_BLOCKS: tl.constexpr,
    SPAN: tl.constexpr,
    WIDTH: tl.constexpr,
    NOW_FROM_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    now = _load_row_value(now_ptr, now_val, row, stride_now, NOW_FROM_PTR)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    bucket, evictable = _block_buckets(
        last_use_ptr, evictable_ptr, row, cols, n, stride_lu, stride_ev, now, SPAN, WIDTH
    )
    cut = tl.load(cut_ptr + row * 2).to(tl.int32)
    take_in_cut = tl.load(cut_ptr + row * 2 + 1)
    in_cut = evictable & (bucket == cut)
    rank = tl.load(block_off_ptr + row * NUM_BLOCKS + blk) + tl.cumsum(in_cut.to(tl.int32), 0)
    victim = tl.where(in_cut, rank <= take_in_cut, evictable & (bucket > cut))
    tl.store(out_ptr + row * n + cols, victim.to(tl.uint8), mask=cols < n)
