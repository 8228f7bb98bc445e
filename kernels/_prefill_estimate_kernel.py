"""Triton body of the strided block-mass estimate (see ``prefill_estimate.py`` for the
launcher, the layout and the torch reference).

``_strided_mass_fwd``, grid ``(Hkv, M)``: one program takes one KV head and one query block.
Its rows are the block's query groups of ``S`` positions for each of the KV head's ``G``
query heads (``G * BLOCK_SIZE / S`` rows). It averages each group's queries itself (reading
the chunk's q once, no padded copy), then makes two passes over the block-mean keys left of
and at the diagonal, ``BLOCK_J`` blocks a tile: the first finds each row's softmax max and
sum (online, base 2), the second sums the normalised probabilities over the rows, each
weighted by the chunk positions its group holds, into the query block's row of masses. No
[rows, J] logits ever reach memory; in torch the same estimate writes and rereads them
five times.

Every row of a query block has the same causal limit (its diagonal key block), so one
column mask serves the tile. ``INTERPRETED``: dots in fp32 and ``while`` loops, as in
``_block_sparse_prefill_kernel.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._block_sparse_prefill_kernel import _dot


@triton.jit
def _tile_logits(q, km_base, stride_kj, t, diag, offs_j, offs_d, d_ok, scale_log2,
                 BLOCK_J: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Base-2 logits of the rows against key blocks [t * BLOCK_J, (t + 1) * BLOCK_J), -inf
    right of the diagonal: [ROWS, BLOCK_J] fp32, and those blocks' indices."""
    j = t * BLOCK_J + offs_j
    visible = j <= diag
    km = tl.load(km_base + j[:, None].to(tl.int64) * stride_kj + offs_d[None, :],
                 mask=visible[:, None] & d_ok[None, :], other=0.0)
    s = _dot(q, tl.trans(km), DOT_PRECISION, INTERPRETED) * scale_log2
    return tl.where(visible[None, :], s, float("-inf")), j, visible


# The chunk's length and position and the output's strides change every prompt step: not
# specialised (one compile, not one per divisibility pattern; see _block_sparse_prefill_fwd).
@triton.jit(do_not_specialize=["num_tokens", "context_start", "stride_oh", "stride_om"])
def _strided_mass_fwd(
    q_ptr, km_ptr, out_ptr,
    scale_log2,  # D ** -0.5 * log2(e)
    stride_qt, stride_qh, stride_kh, stride_kj, stride_oh, stride_om,
    num_tokens, context_start,
    G: tl.constexpr, S: tl.constexpr, PER: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    kvh = tl.program_id(0)
    m = tl.program_id(1)
    diag = context_start // BLOCK_SIZE + m  # the query block's own key block
    offs_r = tl.arange(0, ROWS)
    offs_j = tl.arange(0, BLOCK_J)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    g = offs_r // PER  # query head within the KV head's group
    row_ok = g < G
    head = kvh * G + g
    first_pos = diag * BLOCK_SIZE + (offs_r % PER) * S  # each group's first position

    # Group means of the queries, over the group's positions inside the chunk.
    q_sum = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    count = tl.zeros([ROWS], dtype=tl.float32)
    for i in tl.static_range(S):
        row = first_pos + i - context_start
        ok = row_ok & (row >= 0) & (row < num_tokens)
        q_sum += tl.load(q_ptr + row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        count += ok.to(tl.float32)
    # The dots run in the inputs' dtype, as the torch estimate's do.
    q = (q_sum / tl.maximum(count, 1.0)[:, None]).to(q_ptr.dtype.element_ty)
    km_base = km_ptr + kvh.to(tl.int64) * stride_kh
    num_tiles = diag // BLOCK_J + 1

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if INTERPRETED:
        t = 0
        while t < num_tiles:
            s, j, visible = _tile_logits(q, km_base, stride_kj, t, diag, offs_j, offs_d, d_ok, scale_log2,
                                         BLOCK_J, DOT_PRECISION, INTERPRETED)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
            t += 1
    else:
        for t in range(0, num_tiles):
            s, j, visible = _tile_logits(q, km_base, stride_kj, t, diag, offs_j, offs_d, d_ok, scale_log2,
                                         BLOCK_J, DOT_PRECISION, INTERPRETED)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new

    # Each row's probabilities weigh as many positions as its group holds; a block's row of
    # masses sums to 1 (G heads x the block's chunk positions).
    weight = count / l_i
    weight = tl.where(row_ok, weight, 0.0) / tl.sum(tl.where(row_ok, count, 0.0), 0)
    out_row = out_ptr + kvh.to(tl.int64) * stride_oh + m.to(tl.int64) * stride_om
    if INTERPRETED:
        t = 0
        while t < num_tiles:
            s, j, visible = _tile_logits(q, km_base, stride_kj, t, diag, offs_j, offs_d, d_ok, scale_log2,
                                         BLOCK_J, DOT_PRECISION, INTERPRETED)
            p = tl.exp2(s - m_i[:, None]) * weight[:, None]
            tl.store(out_row + j, tl.sum(p, 0), mask=visible)
            t += 1
    else:
        for t in range(0, num_tiles):
            s, j, visible = _tile_logits(q, km_base, stride_kj, t, diag, offs_j, offs_d, d_ok, scale_log2,
                                         BLOCK_J, DOT_PRECISION, INTERPRETED)
            p = tl.exp2(s - m_i[:, None]) * weight[:, None]
            tl.store(out_row + j, tl.sum(p, 0), mask=visible)
