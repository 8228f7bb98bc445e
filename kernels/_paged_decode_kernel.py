"""Triton bodies of paged decode attention (see ``paged_decode.py`` for the launcher).

Importing this module needs Triton. ``paged_decode.py`` imports it lazily, so the pure-torch
reference works without Triton.

Two kernels:

``_paged_decode_fwd``
    grid ``(B * Hkv, num_splits)``. One program takes one (request, KV head) and one slice of
    the request's tokens, and computes attention for all ``G`` query heads of that KV head at
    once as a ``[G_PAD, D_PAD]`` block (``G_PAD >= 16`` so that ``tl.dot`` applies). It walks
    its slice ``BLOCK_N`` tokens at a time, gathering K/V rows through the block table, with an
    online softmax in fp32 (base 2: the scale is pre-multiplied by log2(e)).
    With one split it writes the normalised output directly. With several it writes, per
    split, the normalised partial output and its log2-sum-exp into fp32 scratch.

``_paged_decode_reduce``
    grid ``(B * H,)``. Merges the splits of one (request, query head) by their log-sum-exp.

Token slices are cut in units of ``BLOCK_N`` from the request's own length, read on the
device, so neither kernel needs host-side knowledge of ``seq_lens``. A split with no tokens
(short request, many splits) writes an empty partial (lse = -inf, output 0); a request with
``seq_len == 0`` gets an all-zero output.

``INTERPRETED`` (set by the launcher under ``TRITON_INTERPRET=1``) works around two limits
of Triton 3.6's interpreter: ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns (the
interpreter has no bf16 arithmetic), so both dots run in fp32 there (P is still rounded to the
KV dtype first, as on the GPU); and ``range()`` with tensor bounds fails under numpy >= 2.4
(triton-lang/triton#9171), so the token loop is a ``while`` loop there. Compiled kernels
take the other branch of both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_block(
    q,
    k_ptr,
    v_ptr,
    bt_row,
    blk,
    seq_len,
    key_start,
    max_pages,
    m_i,
    l_i,
    acc,
    qk_scale,
    stride_kn,
    stride_ks,
    stride_vn,
    stride_vs,
    stride_btp,
    offs_n,
    offs_d,
    d_mask,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One online-softmax step over tokens [blk * BLOCK_N, (blk + 1) * BLOCK_N), those in
    [key_start, seq_len) only."""
    tok = blk * BLOCK_N + offs_n
    tok_mask = (tok < seq_len) & (tok >= key_start)
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole block lies in one page: one page id, contiguous rows.
        page = (blk * BLOCK_N) // PAGE_SIZE
        phys = tl.load(bt_row + page * stride_btp, mask=page < max_pages, other=0).to(tl.int64)
        k_rows = k_ptr + phys * stride_kn + (tok % PAGE_SIZE)[:, None] * stride_ks
        v_rows = v_ptr + phys * stride_vn + (tok % PAGE_SIZE)[:, None] * stride_vs
    else:
        # Several pages per block: one page id per row.
        page = tok // PAGE_SIZE
        phys = tl.load(
            bt_row + page * stride_btp, mask=tok_mask & (page < max_pages), other=0
        ).to(tl.int64)
        k_rows = k_ptr + phys[:, None] * stride_kn + (tok % PAGE_SIZE)[:, None] * stride_ks
        v_rows = v_ptr + phys[:, None] * stride_vn + (tok % PAGE_SIZE)[:, None] * stride_vs
    kv_mask = tok_mask[:, None] & d_mask[None, :]
    k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]

    if INTERPRETED:
        # The interpreter multiplies bf16 bit patterns in tl.dot; compute in fp32 there.
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G_PAD, BLOCK_N] fp32
    s = tl.where(tok_mask[None, :], s * qk_scale, float("-inf"))

    # Every block visited holds at least one valid token, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    p = p.to(v.dtype)  # P @ V in the KV dtype, as in flash attention
    if INTERPRETED:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# The block tables' strides and width follow the step's widest selection and the split count its
# batch: as runtime integers (not specialised on being 1 or a multiple of 16, nor the split count a
# constexpr) they leave one compile for every step, where a new value once compiled a variant
# inside a served step (about 0.7 s on the H200).
@triton.jit(do_not_specialize=["stride_btb", "stride_bth", "max_pages", "split_blocks"])
def _paged_decode_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    sl_ptr,
    ks_ptr,  # [B] int32 each row's first key (HAS_START), else unread
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_vn,
    stride_vs,
    stride_btb,
    stride_bth,
    stride_btp,
    stride_slb,
    stride_slh,  # 0 when seq_lens is per request only
    stride_ob,
    stride_oh,
    max_pages,  # block_tables.shape[2]
    split_blocks,  # > 0: every split takes this many blocks (balanced); 0: a row's blocks / num_splits
    HKV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one program along axis 1 (their count: tl.num_programs(1))
    HAS_START: tl.constexpr,  # rows start at ks_ptr[b] (a sliding window), not at token 0
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    b64 = b.to(tl.int64)

    seq_len = tl.load(sl_ptr + b * stride_slb + kvh * stride_slh)
    key_start = 0
    if HAS_START:
        key_start = tl.load(ks_ptr + b)
    first_blk = key_start // BLOCK_N  # blocks wholly before the first key are not visited
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    num_splits = tl.num_programs(1)
    blocks_per_split = tl.cdiv(n_blocks - first_blk, num_splits)
    if split_blocks > 0:
        blocks_per_split = split_blocks
    blk_start = first_blk + split * blocks_per_split
    blk_end = tl.minimum(blk_start + blocks_per_split, n_blocks)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g  # query heads of this group

    q_ptrs = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)

    bt_row = bt_ptr + b64 * stride_btb + kvh * stride_bth

    if INTERPRETED:
        # triton 3.6's interpreter cannot take tensor loop bounds in range() with
        # numpy >= 2.4 (triton-lang/triton#9171); a while loop avoids __index__.
        blk = blk_start
        while blk < blk_end:
            m_i, l_i, acc = _attend_block(
                q, k_ptr, v_ptr, bt_row, blk, seq_len, key_start, max_pages, m_i, l_i, acc, qk_scale,
                stride_kn, stride_ks, stride_vn, stride_vs, stride_btp, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, INTERPRETED,
            )
            blk += 1
    else:
        for blk in range(blk_start, blk_end):
            m_i, l_i, acc = _attend_block(
                q, k_ptr, v_ptr, bt_row, blk, seq_len, key_start, max_pages, m_i, l_i, acc, qk_scale,
                stride_kn, stride_ks, stride_vn, stride_vs, stride_btp, offs_n, offs_d, d_mask,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, INTERPRETED,
            )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if not SPLIT:
        out_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(
            out_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :]
        )
    else:
        # Scratch layout: part_o [B, H, num_splits, D], part_lse [B, H, num_splits], contiguous.
        # Balanced splits past a row's blocks write nothing: the reduce reads a row's own
        # split count (at the widest heads' count, most of a narrow head's splits are empty).
        written = g_mask & ((split_blocks == 0) | (blk_start < n_blocks))
        row = (b64 * (HKV * G) + heads) * num_splits + split  # [G_PAD]
        tl.store(
            part_o_ptr + row[:, None] * D + offs_d[None, :],
            o,
            mask=written[:, None] & d_mask[None, :],
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=written)


# One compile per power-of-two SPLITS_PAD.
@triton.jit(do_not_specialize=["NUM_SPLITS", "split_blocks", "stride_slb", "stride_slh"])
def _paged_decode_reduce(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    sl_ptr,
    stride_ob,
    stride_oh,
    stride_slb,
    stride_slh,
    NUM_SPLITS,
    split_blocks,  # as the main kernel's: > 0, a row's splits are its blocks / split_blocks
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # b * H + h
    b = pid // H
    h = pid % H
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    num_splits = NUM_SPLITS
    if split_blocks > 0:
        seq_len = tl.load(sl_ptr + b * stride_slb + (h // G) * stride_slh)
        num_splits = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), split_blocks)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    row0 = pid.to(tl.int64) * NUM_SPLITS

    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights all 0
    w = tl.exp2(lse - m)  # [SPLITS_PAD]
    o = tl.load(
        part_o_ptr + (row0 + offs_s)[:, None] * D + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    num = tl.sum(o * w[:, None], 0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(out_ptrs, (num / den).to(out_ptr.dtype.element_ty), mask=d_mask)
