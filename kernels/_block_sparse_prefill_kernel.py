"""Triton body of block-sparse causal prefill (see ``block_sparse_prefill.py`` for the
launcher, the layout and the torch reference).

``_block_sparse_prefill_fwd``, grid ``(H, M)``: one program takes one query head and one
query block of ``BLOCK_SIZE`` rows (FlashAttention-2 tiling: the Q tile stays in registers,
K/V tiles of ``BLOCK_N`` rows stream through, online softmax in fp32, base 2). Query heads
are the fastest grid axis, so the ``G`` heads that share a KV head run side by side and read
the same K/V blocks through L2. Query blocks run last-first: the ones with the most causal
blocks start first, the cheap early ones fill the tail of the grid.

The program visits only the key blocks listed for its (KV head, query block), in ascending
order: first every block left of the diagonal without a causal mask, then the diagonal block
(and anything listed past it) with the mask, as FlashAttention splits its loop. Each listed
block is ``BLOCK_SIZE // BLOCK_N`` tiles.

``INTERPRETED`` works around Triton 3.6's interpreter as in ``_paged_decode_kernel.py``: dots
in fp32 (no bf16 arithmetic there) and ``while`` loops (``range`` with tensor bounds fails
under numpy >= 2.4, triton-lang/triton#9171).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # the interpreter multiplies bf16 bit patterns in tl.dot: fp32 there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, k_base, v_base, kvh, start, q_pos, num_keys, m_i, l_i, acc, qk_scale,
                 stride_kt, stride_vt, offs_n, offs_d, d_ok,
                 BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr, USE_DESC: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N). With USE_DESC, k_base and
    v_base are [Hkv, num_keys, D] tensor descriptors (bulk tensor copies; keys past num_keys
    arrive as zeros), else pointers to KV head kvh."""
    k_pos = start + offs_n  # [BLOCK_N]
    if MASKED:
        kv_ok = (k_pos < num_keys)[:, None] & d_ok[None, :]
    else:
        kv_ok = d_ok[None, :]
    if USE_DESC:
        k = k_base.load([kvh, start, 0]).reshape([BLOCK_N, D_PAD])
    else:
        k = tl.load(k_base + k_pos[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    # Raw scores; the scale is applied inside the exponent (one FMA per score, no extra pass).
    s = _dot(q, tl.trans(k), DOT_PRECISION, INTERPRETED)  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_DESC:
        v = v_base.load([kvh, start, 0]).reshape([BLOCK_N, D_PAD])
    else:
        v = tl.load(v_base + k_pos[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
    pv = _dot(p.to(v.dtype), v, DOT_PRECISION, INTERPRETED)  # P @ V in the KV dtype, as in FlashAttention
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_tiles(q, k_base, v_base, kvh, ids_row, t_start, t_end, q_pos, num_keys, m_i, l_i, acc, qk_scale,
                  stride_kt, stride_vt, offs_n, offs_d, d_ok,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                  USE_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Tiles t_start .. t_end - 1 of the listed blocks (BLOCK_SIZE // BLOCK_N tiles a block)."""
    TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    if INTERPRETED:
        t = t_start
        while t < t_end:
            start = tl.load(ids_row + t // TILES) * BLOCK_SIZE + (t % TILES) * BLOCK_N
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, kvh, start, q_pos, num_keys, m_i, l_i, acc, qk_scale,
                                         stride_kt, stride_vt, offs_n, offs_d, d_ok,
                                         BLOCK_N, D_PAD, MASKED, USE_DESC, DOT_PRECISION, INTERPRETED)
            t += 1
    else:
        for t in range(t_start, t_end):
            start = tl.load(ids_row + t // TILES) * BLOCK_SIZE + (t % TILES) * BLOCK_N
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, kvh, start, q_pos, num_keys, m_i, l_i, acc, qk_scale,
                                         stride_kt, stride_vt, offs_n, offs_d, d_ok,
                                         BLOCK_N, D_PAD, MASKED, USE_DESC, DOT_PRECISION, INTERPRETED)
    return m_i, l_i, acc


def _prune_configs(configs, named_args, **kwargs):
    """Autotune candidates whose key tile divides the block (BLOCK_N | BLOCK_SIZE); the
    launcher tunes only blocks of >= AUTOTUNE_MIN_BLOCK positions, which every 64 divides."""
    block_size = kwargs.get("BLOCK_SIZE", named_args.get("BLOCK_SIZE"))
    return [c for c in configs if block_size % c.kwargs["BLOCK_N"] == 0]


AUTOTUNE_MIN_BLOCK = 64


# Hopper-friendly tiles for a 128-row query block at D <= 128 (wgmma over 8 warps): 64- or
# 128-key K/V tiles, 2-4 pipeline stages. The first is the fixed launch of earlier versions,
# so tuning never picks something slower than it on the tuned shape.
def _set_desc_blocks(nargs):
    """Autotune pre-hook: the K/V descriptors' block shape is the candidate's [1, BLOCK_N, D]."""
    for name in ("k_desc", "v_desc"):
        desc = nargs[name]
        if hasattr(desc, "block_shape"):
            desc.block_shape = [1, nargs["BLOCK_N"], desc.shape[-1]]


AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3, pre_hook=_set_desc_blocks),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=4, pre_hook=_set_desc_blocks),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2, pre_hook=_set_desc_blocks),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3, pre_hook=_set_desc_blocks),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3, pre_hook=_set_desc_blocks),
]


# Not specialised: the chunk's length and position, its query-block count and the strides of
# its block lists change from one prompt step to the next; Triton would otherwise compile a
# variant for each pattern of (== 1, divisible by 16) among them, seconds each, in the middle
# of a served step. size_class is a key of the autotuner, not a compile variant.
@triton.jit(do_not_specialize=["num_tokens", "context_start", "num_q_blocks", "size_class",
                               "stride_ih", "stride_im", "stride_ch", "stride_cm"])
def _block_sparse_prefill_fwd(
    q_ptr, k_ptr, v_ptr, ids_ptr, cnt_ptr, out_ptr,
    k_desc, v_desc,  # USE_DESC: [Hkv, num_keys, D] tensor descriptors of k and v (else unused)
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt,
    stride_ih, stride_im, stride_ch, stride_cm, stride_ot, stride_oh,
    num_tokens,  # n: query rows of the chunk
    context_start,  # position of the chunk's first row
    num_q_blocks,  # M
    size_class,  # autotune key only (``size_class`` in the launcher): not read here
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_DESC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    h = tl.program_id(0)
    m = num_q_blocks - 1 - tl.program_id(1)
    kvh = h // G
    # Query block m is key block qb (blocks are aligned to positions, not to the chunk):
    #
    #   positions  | qb*BS ...................... (qb+1)*BS - 1 |
    #   chunk rows | qb*BS - cs ... (rows < 0 or >= n are not in this chunk: masked)
    qb = context_start // BLOCK_SIZE + m
    offs_m = tl.arange(0, BLOCK_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q_pos = qb * BLOCK_SIZE + offs_m  # [BLOCK_SIZE]
    rows = q_pos - context_start
    row_ok = (rows >= 0) & (rows < num_tokens)
    num_keys = context_start + num_tokens

    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if USE_DESC:
        k_base = k_desc
        v_base = v_desc
    else:
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    ids_row = ids_ptr + kvh.to(tl.int64) * stride_ih + m * stride_im
    count = tl.load(cnt_ptr + kvh * stride_ch + m * stride_cm)
    last = tl.load(ids_row + tl.maximum(count - 1, 0), mask=count > 0, other=-1)
    num_left = count - (last >= qb).to(tl.int32)  # blocks left of the diagonal: no mask

    m_i = tl.full([BLOCK_SIZE], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    acc = tl.zeros([BLOCK_SIZE, D_PAD], dtype=tl.float32)
    TILES: tl.constexpr = BLOCK_SIZE // BLOCK_N
    m_i, l_i, acc = _attend_tiles(q, k_base, v_base, kvh, ids_row, 0, num_left * TILES, q_pos, num_keys,
                                  m_i, l_i, acc, qk_scale, stride_kt, stride_vt, offs_n, offs_d, d_ok,
                                  BLOCK_SIZE, BLOCK_N, D_PAD, False, USE_DESC, DOT_PRECISION, INTERPRETED)
    m_i, l_i, acc = _attend_tiles(q, k_base, v_base, kvh, ids_row, num_left * TILES, count * TILES, q_pos,
                                  num_keys, m_i, l_i, acc, qk_scale, stride_kt, stride_vt, offs_n, offs_d, d_ok,
                                  BLOCK_SIZE, BLOCK_N, D_PAD, True, USE_DESC, DOT_PRECISION, INTERPRETED)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw no key (no block listed): zeros
    o = acc / l_safe[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The same kernel, its tile chosen once per (block size, head dim, group, size class) by timing
# the candidates on the first launch (CUDA only; the interpreter runs the fixed launch). The
# size class keeps a short warm-up prompt's choice (a grid of a few hundred programs) from
# being reused at 128K.
_block_sparse_prefill_fwd_tuned = triton.autotune(
    configs=AUTOTUNE_CONFIGS, key=["BLOCK_SIZE", "D_PAD", "G", "size_class"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_block_sparse_prefill_fwd)

# With K/V tensor descriptors available: the pointer candidates and the same tiles loading
# K/V by bulk tensor copies (USE_DESC), timed against each other.
DESC_AUTOTUNE_CONFIGS = [
    triton.Config({**c.kwargs, "USE_DESC": use_desc}, num_warps=c.num_warps, num_stages=c.num_stages,
                  pre_hook=_set_desc_blocks)
    for use_desc in (False, True) for c in AUTOTUNE_CONFIGS
]
_block_sparse_prefill_fwd_tuned_desc = triton.autotune(
    configs=DESC_AUTOTUNE_CONFIGS, key=["BLOCK_SIZE", "D_PAD", "G", "size_class"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_block_sparse_prefill_fwd)
