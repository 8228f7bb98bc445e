"""Triton bodies of ``page_select.py`` (launchers, checks and references live there)."""

import triton
import triton.language as tl


# The Select kernels' page counts, widths and the strides that follow them change from step to
# step (the batch's longest context, its widest selection): as runtime integers they leave one
# compile per constexpr bucket, where each new value once compiled a variant (being 1 or a multiple
# of 16) inside a served step: ~1 s each on the H200. The same below and in the lookup kernels.
@triton.jit(do_not_specialize=["stride_pb", "P"])
def _page_scores(q_ptr, kmin_ptr, kmax_ptr, pages_ptr, out_ptr,
                 stride_qb, stride_qh, stride_mn, stride_mh, stride_xn, stride_xh,
                 stride_pb, P,
                 HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                 D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)  # b * HKV + h
    b = pid // HKV
    h = pid % HKV
    qsum, qabs = _quest_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    rows = tl.load(pages_ptr + b.to(tl.int64) * stride_pb + offs_p, mask=p_ok, other=0).to(tl.int64)
    score = _quest_scores(kmin_ptr, kmax_ptr, rows, h, stride_mn, stride_mh, stride_xn, stride_xh, p_ok,
                          qsum, qabs, D, D_PAD)
    tl.store(out_ptr + pid.to(tl.int64) * P + offs_p, score, mask=p_ok)


@triton.jit
def _quest_query(q_ptr, b, h, stride_qb, stride_qh,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """(qsum, qabs) [D_PAD] float32: the G query heads of KV head h of request b, summed
    and summed in absolute value."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    return tl.sum(q, 0), tl.sum(tl.abs(q), 0)


@triton.jit
def _quest_scores(kmin_ptr, kmax_ptr, rows, h, stride_mn, stride_mh, stride_xn, stride_xh, p_ok, qsum, qabs,
                  D: tl.constexpr, D_PAD: tl.constexpr):
    """[BLOCK_P] float32 Quest scores of KV head h at the index rows ``rows`` (where p_ok)."""
    offs_d = tl.arange(0, D_PAD)
    m = p_ok[:, None] & (offs_d < D)[None, :]
    lo = tl.load(kmin_ptr + rows[:, None] * stride_mn + h * stride_mh + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    hi = tl.load(kmax_ptr + rows[:, None] * stride_xn + h * stride_xh + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    return _box_scores(lo, hi, qsum, qabs)


@triton.jit
def _box_scores(lo, hi, qsum, qabs):
    """[BLOCK_P] float32 Quest scores of bounds lo, hi [BLOCK_P, D_PAD] (float32) for the
    summed query (qsum, qabs) [D_PAD]."""
    written = hi >= lo  # never-written pages hold +inf / -inf
    center = tl.where(written, (lo + hi) * 0.5, 0.0)
    radius = tl.where(written, (hi - lo) * 0.5, 0.0)
    return tl.sum(center * qsum[None, :] + radius * qabs[None, :], 1)  # [BLOCK_P]


@triton.jit
def _sortable(x):
    """float32 -> uint32 key with the same order (finite values and +-inf): 32-bit keys, as
    the radix passes' per-key shifts and compares cost twice as much on int64."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _bit_length(x):
    """Bits of x, an int64 in [0, 2^52): 0 for 0, else floor(log2(x)) + 1 (the exponent of
    x as a float64, which holds it exactly)."""
    e = (x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 2047
    return tl.where(x > 0, e - 1022, 0).to(tl.int32)


@triton.jit
def _digit_hist(ukey, valid, prefix, shift, upper):
    """[256] histogram of bits [shift, upper) (at most 8) of the valid keys whose bits from
    ``upper`` up (upper <= 32; prefix an int64) match ``prefix``'s: the digits found so far."""
    high = ((tl.full((), 4294967295, tl.int64) >> upper) << upper).to(tl.uint32)  # no 32-bit shift by 32
    cand = valid & ((ukey & high) == prefix.to(tl.uint32))
    digit = ((ukey >> shift.to(tl.uint32)) & ((1 << (upper - shift)) - 1).to(tl.uint32)).to(tl.int32)
    return tl.histogram(digit, 256, mask=cand)


@triton.jit
def _take_top(x, valid, budget, always):
    """(keep, pos) over a row x (one tile): keep = ``always`` (entries that are not valid ones,
    e.g. the sink and local pages) and the ``budget`` largest valid entries (ties: lowest
    index; budget at most the valid entries); pos = a kept entry's place among the kept, in
    index order (0-based). The threshold is a radix select (``_radix_cut``), the places one
    scan (``_places``)."""
    key = _sortable(x)
    top, shift, need = _radix_cut(key, valid, key, valid, budget, False)
    keep, pos, _ = _places(key, valid, always, top, shift, need, budget, 0)
    return keep, pos


@triton.jit
def _take_top2(x1, v1, a1, x2, v2, a2, budget):
    """``_take_top`` over a row held as two tiles, x1 then x2 (a row of P1 + P2 keys, where
    one power-of-two tile would pad it to 2 * P1): (keep1, pos1, keep2, pos2),
    ties to the lowest index (every key of x1 before every key of x2)."""
    u1 = _sortable(x1)
    u2 = _sortable(x2)
    top, shift, need = _radix_cut(u1, v1, u2, v2, budget, True)
    keep1, pos1, packed1 = _places(u1, v1, a1, top, shift, need, budget, 0)
    keep2, pos2, _ = _places(u2, v2, a2, top, shift, need, budget, tl.sum(packed1, 0))
    return keep1, pos1, keep2, pos2


@triton.jit
def _places(key, valid, always, top, shift, need, budget, base):
    """(keep, pos, packed) of one tile of a ranked row (``_radix_cut``'s top, shift and need):
    kept for sure are ``always`` and the keys above the threshold, then the first ``need``
    keys equal to it. Both counts run in one scan, packed in a uint32 (the sure ones times
    2^16 plus the tied ones: rows of fewer than 2^16 entries, 2M tokens at 32-token pages);
    ``base``: the packed counts of the tiles before this one."""
    on = budget > 0
    k = key >> shift.to(tl.uint32)
    t = top.to(tl.uint32)
    sure = always | (valid & (k > t) & on)
    equal = valid & (k == t) & on
    packed = sure.to(tl.uint32) * 65536 + equal.to(tl.uint32)
    c = base + tl.cumsum(packed, 0)
    ties = (c & 65535).to(tl.int32)
    keep = sure | (equal & (ties <= need))
    return keep, (c >> 16).to(tl.int32) + tl.minimum(ties, need) - 1, packed


@triton.jit
def _span(hi_a, lo_a, n_a, hi_b, lo_b, n_b):
    """Combine of (largest key, smallest key, count)."""
    return tl.maximum(hi_a, hi_b), tl.minimum(lo_a, lo_b), n_a + n_b


@triton.jit
def _key_span(u, valid):
    """(largest, smallest, count) of a tile's valid uint32 keys, in one reduction."""
    return tl.reduce((tl.where(valid, u, tl.zeros_like(u)), tl.where(valid, u, tl.full(u.shape, 4294967295, tl.uint32)),
                      valid.to(tl.int32)), 0, _span)


@triton.jit
def _last_bin(d_a, at_a, in_a, d_b, at_b, in_b):
    """Combine keeping the larger bin index with its two counts."""
    b = d_b > d_a
    return tl.where(b, d_b, d_a), tl.where(b, at_b, at_a), tl.where(b, in_b, in_a)


@triton.jit
def _radix_cut(u1, v1, u2, v2, budget, TWO: tl.constexpr):
    """(top, shift, need): the ``budget`` largest valid keys of u1 (and of u2 when TWO; uint32)
    are those with ``u >> shift`` above ``top`` and the ``need`` lowest-index ones equal to it
    (need = budget - the keys above); top and shift as int64 and int32 scalars.

    A radix select, no sort (a bisection needs 33 counting passes): passes of up to 8 bits
    from the most significant, each a 256-bin histogram of the keys that match the digits found
    so far, and the largest digit d with at least ``need`` keys at or above it. Two things keep
    the passes few, as one program ranks a row and each block-wide reduction is a barrier on
    the step's latency path:
      * the first pass starts at the highest bit where the valid keys differ (their largest
        and smallest keys tell it): the bits above it are the same in every key. Scores of
        one sign and a few octaves share their sign and upper exponent bits, which a pass
        from bit 31 spent a whole pass on.
      * the passes stop once bin d is needed whole (the keys above it and all of it make
        exactly ``budget``): spread scores are split after two passes, mostly.
    A pass costs a histogram, a scan and one reduction: the keys at or above each bin come
    from the scan and the count the last pass left (bin d's), and d with its two counts from
    one reduction of three operands (``_last_bin``), as the keys' span and count before the
    passes (``_span``)."""
    bins = tl.arange(0, 256)
    hi, lo, total = _key_span(u1, v1)
    if TWO:
        hi2, lo2, total2 = _key_span(u2, v2)
        hi, lo, total = _span(hi, lo, total, hi2, lo2, total2)
    hi = hi.to(tl.int64)
    upper = _bit_length(hi ^ lo.to(tl.int64))  # bits from here up: the same in every valid key
    prefix = (hi >> upper) << upper
    shift = upper
    need = budget
    done = upper == 0  # every valid key the same (or none): the ties decide
    while ~done:
        shift = tl.maximum(upper - 8, 0)
        hist = _digit_hist(u1, v1, prefix, shift, upper)
        if TWO:
            hist += _digit_hist(u2, v2, prefix, shift, upper)
        at_least = total - tl.cumsum(hist, 0) + hist  # candidates with a digit >= the bin's
        # d: the last bin with at_least >= need (bin 0 if none), with its two counts
        d, at_d, in_d = tl.reduce((tl.where((at_least >= need) | (bins == 0), bins, -1), at_least, hist), 0,
                                  _last_bin)
        rest = need - (at_d - in_d)  # what bin d must still give
        prefix = prefix | (d.to(tl.int64) << shift)
        done = (rest == in_d) | (shift == 0)
        need = rest
        total = in_d
        upper = shift
    return prefix >> shift, shift, need


@triton.jit(do_not_specialize=["P", "K"])
def _topk_ragged(s_ptr, bud_ptr, out_ptr, P, K, P_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P_PAD)
    ok = offs < P
    x = tl.load(s_ptr + row * P + offs, mask=ok, other=float("-inf"))
    valid = ok & (x > float("-inf"))
    n_valid = tl.sum(valid.to(tl.int32), 0)
    budget = tl.minimum(tl.minimum(tl.load(bud_ptr + row), K), n_valid)
    sel, pos = _take_top(x, valid, budget, offs < 0)  # pos: ascending page order
    tl.store(out_ptr + row * K + pos, offs.to(tl.int64), mask=sel & (pos < K))


@triton.jit(do_not_specialize=["P", "W"])
def _select_ragged(s_ptr, n_ptr, bud_ptr, want_ptr, count_ptr, P, W, SINK, LOCAL,
                   HKV: tl.constexpr, P_PAD: tl.constexpr, W_PAD: tl.constexpr, TAIL: tl.constexpr):
    """TAIL > 0: the row is a tile of P_PAD pages and a tail tile of TAIL pages after it
    (``page_select.row_tiles``), else one tile of P_PAD."""
    row = tl.program_id(0).to(tl.int64)  # b * HKV + h
    offs = tl.arange(0, P_PAD)
    n = tl.load(n_ptr + row // HKV)
    in_ctx = offs < n
    s_end, l_start = _edges(n, SINK, LOCAL)
    n_edge = s_end + n - l_start
    edge = in_ctx & ((offs < s_end) | (offs >= l_start))  # sink and local pages
    x = tl.load(s_ptr + row * P + offs, mask=offs < P, other=float("-inf"))
    valid = in_ctx & ~edge & (x > float("-inf"))
    if TAIL == 0:
        budget = tl.minimum(tl.load(bud_ptr + row).to(tl.int32), tl.sum(valid.to(tl.int32), 0))
        keep, pos = _take_top(x, valid, budget, edge)  # pos: ascending page order
        tl.store(want_ptr + row * W + pos, offs.to(tl.int64), mask=keep & (pos < W))
        count = n_edge + tl.maximum(budget, 0)  # the radix select keeps exactly budget
    else:
        offs2 = P_PAD + tl.arange(0, TAIL)
        in_ctx2 = offs2 < n
        edge2 = in_ctx2 & ((offs2 < s_end) | (offs2 >= l_start))
        x2 = tl.load(s_ptr + row * P + offs2, mask=offs2 < P, other=float("-inf"))
        valid2 = in_ctx2 & ~edge2 & (x2 > float("-inf"))
        n_valid = tl.sum(valid.to(tl.int32), 0) + tl.sum(valid2.to(tl.int32), 0)
        budget = tl.minimum(tl.load(bud_ptr + row).to(tl.int32), n_valid)
        keep, pos, keep2, pos2 = _take_top2(x, valid, edge, x2, valid2, edge2, budget)
        tl.store(want_ptr + row * W + pos, offs.to(tl.int64), mask=keep & (pos < W))
        tl.store(want_ptr + row * W + pos2, offs2.to(tl.int64), mask=keep2 & (pos2 < W))
        count = n_edge + tl.maximum(budget, 0)
    offs_w = tl.arange(0, W_PAD)
    tl.store(want_ptr + row * W + offs_w, tl.full((W_PAD,), -1, tl.int64), mask=(offs_w >= count) & (offs_w < W))
    tl.store(count_ptr + row, count.to(tl.int64))


@triton.jit(do_not_specialize=["P"])
def _label_scores(qr_ptr, labels_ptr, rows_ptr, lengths_ptr, held_ptr, out_ptr,
                  stride_qb, stride_qh, stride_ln, stride_lh, span, P, margin,
                  HKV: tl.constexpr, HKV_PAD: tl.constexpr, RC: tl.constexpr, RC_PAD: tl.constexpr,
                  S: tl.constexpr, BLOCK_P: tl.constexpr, HAS_HELD: tl.constexpr):
    """Page scores from a label cache: per request b, KV head and page, the largest
    qr . label_t over the page's written tokens (qr: the query summed over the KV head's
    query heads, in the label channels). Grid (B, cdiv(P, BLOCK_P)): a program takes a block
    of pages for every KV head at once, so that its tile [BLOCK_P * S, HKV, RC] is one
    contiguous run of the index (a token's labels of all heads sit side by side; one program
    per head read every r-th run of bytes, each line of the index by Hkv / 4 programs).
    HAS_HELD: ``margin`` added to the pages held_ptr [B, Hkv, P] flags (Select's hysteresis)."""
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n_tok = tl.load(lengths_ptr + row)
    offs_h = tl.arange(0, HKV_PAD)
    offs_c = tl.arange(0, RC_PAD)
    hc_ok = (offs_h < HKV)[:, None] & (offs_c < RC)[None, :]
    q = tl.load(qr_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_c[None, :], mask=hc_ok,
                other=0.0).to(tl.float32)  # [HKV_PAD, RC_PAD]
    tokens = tl.program_id(1) * (BLOCK_P * S) + tl.arange(0, BLOCK_P * S)  # [BLOCK_P * S]
    ok = (tokens < P * S) & (tokens < n_tok)
    ptrs = (labels_ptr + (row * span + tokens)[:, None, None] * stride_ln + offs_h[None, :, None] * stride_lh
            + offs_c[None, None, :])
    lab = tl.load(ptrs, mask=ok[:, None, None] & hc_ok[None, :, :], other=0.0).to(tl.float32)
    s = tl.sum(lab * q[None, :, :], axis=2)  # [BLOCK_P * S, HKV_PAD]
    s = tl.where(ok[:, None], s, float("-inf"))
    best = tl.max(tl.reshape(s, [BLOCK_P, S, HKV_PAD]), axis=1)  # [BLOCK_P, HKV_PAD]
    pages = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    at = (b.to(tl.int64) * HKV + offs_h[None, :]) * P + pages[:, None]
    out_ok = (pages < P)[:, None] & (offs_h < HKV)[None, :]
    if HAS_HELD:
        best += tl.where(tl.load(held_ptr + at, mask=out_ok, other=0) != 0, margin, 0.0)
    tl.store(out_ptr + at, best, mask=out_ok)


@triton.jit
def _label_query(q_ptr, ids_ptr, out_ptr, stride_qb, stride_qh, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
                 G: tl.constexpr, RC: tl.constexpr, RC_PAD: tl.constexpr):
    """Grid (B,): out[b, h, c] = sum_g q[b, h * G + g, ids[h, c]] in float32, added in head
    order (the reference's order on CUDA up to G = 4; a few bf16 values of like magnitude sum
    exactly in float32 in any order)."""
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HKV_PAD)
    offs_c = tl.arange(0, RC_PAD)
    m = (offs_h < HKV)[:, None] & (offs_c < RC)[None, :]
    ids = tl.load(ids_ptr + offs_h[:, None] * RC + offs_c[None, :], mask=m, other=0)
    at = q_ptr + b * stride_qb + (offs_h * G)[:, None] * stride_qh + ids  # head h's first query head
    acc = tl.zeros([HKV_PAD, RC_PAD], tl.float32)
    for g in tl.static_range(G):
        acc += tl.load(at + g * stride_qh, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + (b * HKV + offs_h[:, None]) * RC + offs_c[None, :], acc, mask=m)


@triton.jit
def _label_append(k_ptr, ids_ptr, slots_ptr, labels_ptr, stride_kt, stride_kh, stride_ln, stride_lh,
                  HKV: tl.constexpr, HKV_PAD: tl.constexpr, RC: tl.constexpr, RC_PAD: tl.constexpr,
                  FP8: tl.constexpr):
    """Grid (T,): token t's labels, k[t, h, ids[h, c]] for every KV head h and channel c, into
    labels[slots[t]] (FP8: clamped to e4m3's +-448, rounded to nearest, stored as its bytes)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HKV_PAD)
    offs_c = tl.arange(0, RC_PAD)
    m = (offs_h < HKV)[:, None] & (offs_c < RC)[None, :]
    ids = tl.load(ids_ptr + offs_h[:, None] * RC + offs_c[None, :], mask=m, other=0)
    x = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + ids, mask=m, other=0.0)
    at = labels_ptr + slot * stride_ln + offs_h[:, None] * stride_lh + offs_c[None, :]
    if FP8:
        y = tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(at, y.to(tl.uint8, bitcast=True), mask=m)
    else:
        tl.store(at, x.to(labels_ptr.dtype.element_ty), mask=m)


@triton.jit
def _edges(n, SINK, LOCAL):
    """(end of the sink pages, start of the local pages) of a row of n pages: the middle pages
    are [s_end, l_start); when the two windows overlap, every page is an edge page."""
    s_end = tl.minimum(n, SINK)
    l_start = tl.maximum(n - LOCAL, s_end)
    return s_end, l_start


@triton.jit
def _row_budget(bud_ptr, dense_ptr, row, HKV: tl.constexpr, HAS_DENSE: tl.constexpr):
    """Middle pages row (b * HKV + h) may take: its budget, or with HAS_DENSE every page when
    request b is flagged in dense_ptr [B] (uint8)."""
    budget = tl.load(bud_ptr + row).to(tl.int32)
    if HAS_DENSE:
        budget = tl.where(tl.load(dense_ptr + row // HKV) != 0, 2147483647, budget)
    return budget


@triton.jit(do_not_specialize=["P", "KC"])
def _select_local(s_ptr, n_ptr, bud_ptr, cs_ptr, ci_ptr, P, SINK, LOCAL, KC,
                  HKV: tl.constexpr, CHUNK: tl.constexpr, KC_PAD: tl.constexpr):
    """Split-row Select, first pass: one program per (row, chunk of CHUNK pages) keeps its
    chunk's top ``budget`` middle pages (radix select, lowest index on ties) as candidates,
    compacted in page order into cs/ci [row, chunk, KC] (scores, page ids; -inf / -1 after).
    The row's top-budget pages are among the union of its chunks' candidates: a page beaten
    by fewer than budget pages of the row is beaten by fewer than budget of its chunk."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n = tl.load(n_ptr + row // HKV)
    s_end, l_start = _edges(n, SINK, LOCAL)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(s_ptr + row * P + offs, mask=offs < P, other=float("-inf"))
    valid = (offs >= s_end) & (offs < l_start) & (x > float("-inf"))
    budget = tl.minimum(tl.minimum(tl.load(bud_ptr + row).to(tl.int32), KC), tl.sum(valid.to(tl.int32), 0))
    _chunk_candidates(x, valid, budget, offs, cs_ptr, ci_ptr, (row * tl.num_programs(1) + chunk) * KC, KC,
                      CHUNK, KC_PAD)


@triton.jit
def _chunk_candidates(x, valid, budget, offs, cs_ptr, ci_ptr, base, KC, CHUNK: tl.constexpr, KC_PAD: tl.constexpr):
    """The top ``budget`` valid entries of a chunk's scores x [CHUNK] (page ids offs), in page
    order, at cs/ci [base, base + KC); -inf / -1 after them."""
    keep, pos = _take_top(x, valid, budget, offs < 0)
    tl.store(cs_ptr + base + pos, x, mask=keep)
    tl.store(ci_ptr + base + pos, offs, mask=keep)
    offs_k = tl.arange(0, KC_PAD)
    rest = (offs_k >= budget) & (offs_k < KC)
    tl.store(cs_ptr + base + offs_k, tl.full((KC_PAD,), float("-inf"), tl.float32), mask=rest)
    tl.store(ci_ptr + base + offs_k, tl.full((KC_PAD,), -1, tl.int32), mask=rest)


@triton.jit(do_not_specialize=["C", "W"])
def _select_merge(cs_ptr, ci_ptr, n_ptr, bud_ptr, dense_ptr, want_ptr, count_ptr, C, W, SINK, LOCAL,
                  HKV: tl.constexpr, C_PAD: tl.constexpr, W_PAD: tl.constexpr, HAS_DENSE: tl.constexpr):
    """Split-row Select, second pass: per row, the top ``budget`` of its C candidates (in
    page order), then the row's pages in ascending order: sink pages, the selected middle
    pages, local pages; -1 up to the width W. Same output as ``_select_ragged``. HAS_DENSE:
    rows flagged in dense_ptr [B] take every valid candidate (``_row_budget``)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row // HKV)
    s_end, l_start = _edges(n, SINK, LOCAL)
    offs = tl.arange(0, C_PAD)
    x = tl.load(cs_ptr + row * C + offs, mask=offs < C, other=float("-inf"))
    ids = tl.load(ci_ptr + row * C + offs, mask=offs < C, other=-1)
    valid = (ids >= 0) & (x > float("-inf"))
    budget = tl.minimum(_row_budget(bud_ptr, dense_ptr, row, HKV, HAS_DENSE), tl.sum(valid.to(tl.int32), 0))
    keep, pos = _take_top(x, valid, budget, offs < 0)
    pos += s_end
    tl.store(want_ptr + row * W + pos, ids.to(tl.int64), mask=keep & (pos < W))
    mid = tl.maximum(budget, 0)  # the radix select keeps exactly budget
    offs_w = tl.arange(0, W_PAD)
    # sink pages at [0, s_end), local pages right after the middle ones, then -1
    local_at = s_end + mid
    count = local_at + n - l_start
    page = tl.where(offs_w < s_end, offs_w, l_start + offs_w - local_at)
    edge = (offs_w < s_end) | ((offs_w >= local_at) & (offs_w < count))
    out = tl.where(edge, page, -1).to(tl.int64)
    tl.store(want_ptr + row * W + offs_w, out, mask=(offs_w < W) & (edge | (offs_w >= count)))
    tl.store(count_ptr + row, count.to(tl.int64))
