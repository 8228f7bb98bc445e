"""Triton bodies of ``coarse_select.py`` (launchers, contract and the reasons live there)."""

import triton
import triton.language as tl

from ._page_select_kernel import _edges, _quest_query, _quest_scores, _row_budget, _take_top, _take_top2


@triton.jit(do_not_specialize=["T", "NC"])
def _coarse_refresh(kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, crow_ptr, T, NC,
                    stride_mn, stride_mh, stride_cn, stride_ch,
                    GP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Grid (T, Hkv): the first token of each run of one coarse row (tokens of a row sit next
    to each other in a step) rebuilds that row from its GP page rows: cmin = min, cmax = max
    over them (pages never written hold +inf / -inf and drop out). Row NC, the dump row, stays."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.load(crow_ptr + t)
    prev = tl.load(crow_ptr + tl.maximum(t - 1, 0))
    _rebuild_group(kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, c.to(tl.int64), h, ((t == 0) | (prev != c)) & (c < NC),
                   stride_mn, stride_mh, stride_cn, stride_ch, GP, D, D_PAD)


@triton.jit
def _rebuild_group(kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, c, h, ok, stride_mn, stride_mh, stride_cn, stride_ch,
                   GP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Where ok: coarse row c of KV head h := the min and max over its GP page rows (pages
    never written hold +inf / -inf and drop out)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D_PAD)
    m = (offs_d < D)[None, :] & (offs_g >= 0)[:, None] & ok
    rows = c * GP + offs_g
    lo = tl.min(tl.load(kmin_ptr + rows[:, None] * stride_mn + h * stride_mh + offs_d[None, :], mask=m,
                        other=float("inf")), 0)
    hi = tl.max(tl.load(kmax_ptr + rows[:, None] * stride_mn + h * stride_mh + offs_d[None, :], mask=m,
                        other=float("-inf")), 0)
    at = c * stride_cn + h * stride_ch + offs_d
    tl.store(cmin_ptr + at, lo.to(cmin_ptr.dtype.element_ty), mask=(offs_d < D) & ok)
    tl.store(cmax_ptr + at, hi.to(cmax_ptr.dtype.element_ty), mask=(offs_d < D) & ok)


@triton.jit
def _held_margin(held_ptr, row, P, g, g_ok, s_end, l_start, margin, GP: tl.constexpr):
    """[len(g)] hysteresis of groups g: ``margin`` where a group holds a held middle page."""
    pg = g[:, None] * GP + tl.arange(0, GP)[None, :]
    pm = g_ok[:, None] & (pg >= s_end) & (pg < l_start)
    held = tl.load(held_ptr + row * P + pg, mask=pm, other=0)
    return tl.where(tl.max(held.to(tl.int32), 1) > 0, margin, 0.0)


@triton.jit
def _has_middle(g, PG, s_end, l_start, GP: tl.constexpr):
    """Groups g that exist and hold a middle page (between the sink and the local pages)."""
    return (g < PG) & (g * GP < l_start) & ((g + 1) * GP > s_end)


@triton.jit
def _middle_budget(bud_ptr, dense_ptr, row, s_end, l_start, HKV: tl.constexpr, HAS_DENSE: tl.constexpr):
    """Middle pages row b * HKV + h takes: its budget (every page for a dense row), at most
    the middle's pages."""
    return tl.maximum(tl.minimum(_row_budget(bud_ptr, dense_ptr, row, HKV, HAS_DENSE), l_start - s_end), 0)


@triton.jit
def _row_setup(n_ptr, pages_ptr, bud_ptr, dense_ptr, row, b, stride_pb, NC, SINK, LOCAL,
               HKV: tl.constexpr, GP: tl.constexpr, HAS_DENSE: tl.constexpr):
    """(n, s_end, l_start, budget, g_last, last, fresh) of row b * HKV + h: its pages, the
    middle's edges, the middle pages it may take, and its last group (the one the decode token
    changed): that group's first page row and whether it is to be rebuilt (not the dump row)."""
    n = tl.load(n_ptr + b).to(tl.int32)
    s_end, l_start = _edges(n, SINK, LOCAL)
    budget = _middle_budget(bud_ptr, dense_ptr, row, s_end, l_start, HKV, HAS_DENSE)
    g_last = (n - 1) // GP
    last = tl.load(pages_ptr + b * stride_pb + g_last * GP)
    fresh = (n > 0) & (last >= 0) & (last // GP < NC)
    return n, s_end, l_start, budget, g_last, last, fresh


@triton.jit
def _score_groups(g, cmin_ptr, cmax_ptr, pages_ptr, held_ptr, gs_ptr, row, b, h, P, PG, s_end, l_start, margin,
                  qsum, qabs, stride_cn, stride_ch, stride_pb,
                  D: tl.constexpr, D_PAD: tl.constexpr, GP: tl.constexpr, HAS_HELD: tl.constexpr):
    """Scores of groups g into gs[row] (-inf: a group with no middle page)."""
    g_ok = _has_middle(g, PG, s_end, l_start, GP)
    # Coarse row of group g: its first page's row // GP (a group's page rows are consecutive).
    first = tl.load(pages_ptr + b * stride_pb + g * GP, mask=g_ok, other=0)
    crow = tl.where(first >= 0, first // GP, 0)
    s = _quest_scores(cmin_ptr, cmax_ptr, crow, h, stride_cn, stride_ch, stride_cn, stride_ch, g_ok,
                      qsum, qabs, D, D_PAD)
    if HAS_HELD:  # hysteresis: a group with a held middle page scores as its held pages do
        s = s + _held_margin(held_ptr, row, P, g, g_ok, s_end, l_start, margin, GP)
    tl.store(gs_ptr + row * PG + g, tl.where(g_ok, s, float("-inf")), mask=g < PG)


@triton.jit
def _keep_groups(gs_ptr, kg_ptr, row, PG, C, budget, FACTOR, GP: tl.constexpr, PG_PAD: tl.constexpr):
    """The best m groups of gs[row] (lowest group first on ties), m = ceil(budget * FACTOR /
    GP) capped at C / GP, written in group order to kg[row, :m]; returns m. gs is read past L1
    (``.cg``): in the spread launch other programs wrote it."""
    g = tl.arange(0, PG_PAD)
    gsc = tl.load(gs_ptr + row * PG + g, mask=g < PG, other=float("-inf"), cache_modifier=".cg")
    g_valid = (g < PG) & (gsc > float("-inf"))
    m = tl.minimum(tl.minimum((budget * FACTOR + GP - 1) // GP, tl.sum(g_valid.to(tl.int32), 0)), C // GP)
    keep_g, at = _take_top(gsc, g_valid, m, g < 0)
    tl.store(kg_ptr + row * PG + at, g, mask=keep_g)
    return m


@triton.jit
def _score_candidates(c, nc, kg_ptr, kmin_ptr, kmax_ptr, pages_ptr, held_ptr, cs_ptr, ci_ptr, row, b, h, P, PG, C,
                      s_end, l_start, margin, qsum, qabs, stride_mn, stride_mh, stride_pb,
                      D: tl.constexpr, D_PAD: tl.constexpr, GP: tl.constexpr, HAS_HELD: tl.constexpr):
    """Candidates c (page c % GP of the (c // GP)-th kept group) scored into cs/ci[row, c]."""
    c_ok = c < nc
    grp = tl.load(kg_ptr + row * PG + c // GP, mask=c_ok, other=0)
    p = grp * GP + c % GP
    ok = c_ok & (p >= s_end) & (p < l_start)
    prow = tl.load(pages_ptr + b * stride_pb + p, mask=ok, other=0).to(tl.int64)
    s = _quest_scores(kmin_ptr, kmax_ptr, prow, h, stride_mn, stride_mh, stride_mn, stride_mh, ok,
                      qsum, qabs, D, D_PAD)
    if HAS_HELD:
        s = s + tl.where(tl.load(held_ptr + row * P + p, mask=ok, other=0) != 0, margin, 0.0)
    tl.store(cs_ptr + row * C + c, tl.where(ok, s, float("-inf")), mask=c_ok)
    tl.store(ci_ptr + row * C + c, p, mask=c_ok)


@triton.jit
def _write_top(cs_ptr, ci_ptr, want_ptr, count_ptr, row, nc, n, s_end, l_start, budget, C, W,
               C_PAD: tl.constexpr, C_TAIL: tl.constexpr, E_PAD: tl.constexpr, TILE: tl.constexpr):
    """The top budget of the row's nc candidates written between its sink and local pages, -1
    after them, and the count. C_TAIL > 0: the candidates as a tile of C_PAD and a tail tile
    after it (as ``_select_ragged``: the widest S-HPLB row's 2136 candidates are 2048 + 128, not
    4096). cs/ci are read past L1 (``.cg``): in the spread launch other programs wrote them."""
    c = tl.arange(0, C_PAD)
    x = tl.load(cs_ptr + row * C + c, mask=c < nc, other=float("-inf"), cache_modifier=".cg")
    pg = tl.load(ci_ptr + row * C + c, mask=c < nc, other=0, cache_modifier=".cg")
    valid = (c < nc) & (x > float("-inf"))
    if C_TAIL == 0:
        take = tl.minimum(budget, tl.sum(valid.to(tl.int32), 0))
        keep, pos = _take_top(x, valid, take, c < 0)
        pos += s_end
        tl.store(want_ptr + row * W + pos, pg.to(tl.int64), mask=keep & (pos < W))
        kept = take  # the radix select keeps exactly take
    else:
        c2 = C_PAD + tl.arange(0, C_TAIL)
        x2 = tl.load(cs_ptr + row * C + c2, mask=c2 < nc, other=float("-inf"), cache_modifier=".cg")
        pg2 = tl.load(ci_ptr + row * C + c2, mask=c2 < nc, other=0, cache_modifier=".cg")
        valid2 = (c2 < nc) & (x2 > float("-inf"))
        take = tl.minimum(budget, tl.sum(valid.to(tl.int32), 0) + tl.sum(valid2.to(tl.int32), 0))
        keep, pos, keep2, pos2 = _take_top2(x, valid, c < 0, x2, valid2, c2 < 0, take)
        pos += s_end
        pos2 += s_end
        tl.store(want_ptr + row * W + pos, pg.to(tl.int64), mask=keep & (pos < W))
        tl.store(want_ptr + row * W + pos2, pg2.to(tl.int64), mask=keep2 & (pos2 < W))
        kept = take
    e = tl.arange(0, E_PAD)
    tl.store(want_ptr + row * W + e, e.to(tl.int64), mask=(e < s_end) & (e < W))
    lp = l_start + e
    lpos = s_end + kept + e
    tl.store(want_ptr + row * W + lpos, lp.to(tl.int64), mask=(lp < n) & (lpos < W))
    count = s_end + kept + (n - l_start)
    w = 0
    while w * TILE < W:
        o = w * TILE + tl.arange(0, TILE)
        tl.store(want_ptr + row * W + o, tl.full((TILE,), -1, tl.int64), mask=(o >= count) & (o < W))
        w += 1
    tl.store(count_ptr + row, count.to(tl.int64))


@triton.jit(do_not_specialize=["P", "PG", "W", "C", "NC"])
def _coarse_select(q_ptr, kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, pages_ptr, n_ptr, bud_ptr, dense_ptr, held_ptr,
                   gs_ptr, kg_ptr, cs_ptr, ci_ptr, want_ptr, count_ptr,
                   stride_qb, stride_qh, stride_mn, stride_mh, stride_cn, stride_ch, stride_pb,
                   P, PG, W, C, NC, SINK, LOCAL, FACTOR, margin,
                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   GP: tl.constexpr, TILE: tl.constexpr, PG_PAD: tl.constexpr, C_PAD: tl.constexpr,
                   E_PAD: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_HELD: tl.constexpr, C_TAIL: tl.constexpr):
    """One program per (request, KV head) row: groups scored from the coarse bounds, the
    best groups kept, their pages scored from the page bounds, the top budget of those
    pages written with the sink and local pages (``coarse_select_ref``'s order)."""
    row = tl.program_id(0).to(tl.int64)  # b * HKV + h
    b = row // HKV
    h = row % HKV
    qsum, qabs = _quest_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    n, s_end, l_start, budget, g_last, last, fresh = _row_setup(n_ptr, pages_ptr, bud_ptr, dense_ptr, row, b,
                                                                stride_pb, NC, SINK, LOCAL, HKV, GP, HAS_DENSE)
    # 0. The request's last group, the one its decode token changed, rebuilt from its pages'
    #    bounds (the only writer of this head's row of it; ``Quest.plan_append``).
    _rebuild_group(kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, last.to(tl.int64) // GP, h, fresh,
                   stride_mn, stride_mh, stride_cn, stride_ch, GP, D, D_PAD)
    tl.debug_barrier()
    # 1. Group scores, TILE groups at a time, into gs[row].
    t = 0
    while t * TILE < PG:
        _score_groups(t * TILE + tl.arange(0, TILE), cmin_ptr, cmax_ptr, pages_ptr, held_ptr, gs_ptr, row, b, h,
                      P, PG, s_end, l_start, margin, qsum, qabs, stride_cn, stride_ch, stride_pb, D, D_PAD, GP,
                      HAS_HELD)
        t += 1
    tl.debug_barrier()
    # 2. The best m groups, in group order, into kg[row].
    m = _keep_groups(gs_ptr, kg_ptr, row, PG, C, budget, FACTOR, GP, PG_PAD)
    tl.debug_barrier()
    # 3. The kept groups' pages, in page order, scored into cs/ci[row, :m * GP].
    nc = m * GP
    t = 0
    while t * TILE < nc:
        _score_candidates(t * TILE + tl.arange(0, TILE), nc, kg_ptr, kmin_ptr, kmax_ptr, pages_ptr, held_ptr,
                          cs_ptr, ci_ptr, row, b, h, P, PG, C, s_end, l_start, margin, qsum, qabs,
                          stride_mn, stride_mh, stride_pb, D, D_PAD, GP, HAS_HELD)
        t += 1
    tl.debug_barrier()
    # 4. The top budget of those pages, written between the sink and the local pages.
    _write_top(cs_ptr, ci_ptr, want_ptr, count_ptr, row, nc, n, s_end, l_start, budget, C, W,
               C_PAD, C_TAIL, E_PAD, TILE)


# The spread launches: a row's two scoring stages over many programs (grid (rows, S)), and the
# ranking after each done by the row's last program to finish (each program counts itself in
# tick[row]; the one that counts S reads what the others wrote, ranks, and resets the count to
# 0 for the next launch). The count is taken after a barrier, by one thread, acquire-release
# at GPU scope: the row's writes before it are visible to the program that reads them.

@triton.jit(do_not_specialize=["P", "PG", "C", "NC", "S"])
def _coarse_groups(q_ptr, cmin_ptr, cmax_ptr, kmin_ptr, kmax_ptr, pages_ptr, n_ptr, bud_ptr, dense_ptr, held_ptr,
                   gs_ptr, kg_ptr, m_ptr, tick_ptr,
                   stride_qb, stride_qh, stride_mn, stride_mh, stride_cn, stride_ch, stride_pb,
                   P, PG, C, NC, S, SINK, LOCAL, FACTOR, margin,
                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   GP: tl.constexpr, GT: tl.constexpr, PG_PAD: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_HELD: tl.constexpr):
    """Grid (rows, S): program s scores groups [s * GT, s * GT + GT) of its row (the one that
    holds the row's last group first rebuilds it); the row's last program to finish keeps the
    best groups into kg[row] and their count into m[row]."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    qsum, qabs = _quest_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    n, s_end, l_start, budget, g_last, last, fresh = _row_setup(n_ptr, pages_ptr, bud_ptr, dense_ptr, row, b,
                                                                stride_pb, NC, SINK, LOCAL, HKV, GP, HAS_DENSE)
    _rebuild_group(kmin_ptr, kmax_ptr, cmin_ptr, cmax_ptr, last.to(tl.int64) // GP, h, fresh & (g_last // GT == s),
                   stride_mn, stride_mh, stride_cn, stride_ch, GP, D, D_PAD)
    tl.debug_barrier()
    _score_groups(s * GT + tl.arange(0, GT), cmin_ptr, cmax_ptr, pages_ptr, held_ptr, gs_ptr, row, b, h,
                  P, PG, s_end, l_start, margin, qsum, qabs, stride_cn, stride_ch, stride_pb, D, D_PAD, GP, HAS_HELD)
    tl.debug_barrier()
    if tl.atomic_add(tick_ptr + row, 1, sem="acq_rel") == S - 1:
        m = _keep_groups(gs_ptr, kg_ptr, row, PG, C, budget, FACTOR, GP, PG_PAD)
        tl.store(m_ptr + row, m)
        tl.store(tick_ptr + row, 0)


@triton.jit(do_not_specialize=["P", "PG", "W", "C", "S"])
def _coarse_pages(q_ptr, kmin_ptr, kmax_ptr, pages_ptr, n_ptr, bud_ptr, dense_ptr, held_ptr,
                  kg_ptr, m_ptr, cs_ptr, ci_ptr, want_ptr, count_ptr, tick_ptr,
                  stride_qb, stride_qh, stride_mn, stride_mh, stride_pb,
                  P, PG, W, C, S, SINK, LOCAL, margin,
                  HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  GP: tl.constexpr, CT: tl.constexpr, TILE: tl.constexpr, C_PAD: tl.constexpr,
                  C_TAIL: tl.constexpr, E_PAD: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_HELD: tl.constexpr):
    """Grid (rows, S): program s scores candidates [s * CT, s * CT + CT) of the kept groups;
    the row's last program to finish writes the top budget of them (``_write_top``)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    n = tl.load(n_ptr + b).to(tl.int32)
    s_end, l_start = _edges(n, SINK, LOCAL)
    nc = tl.load(m_ptr + row) * GP
    if s * CT < nc:
        qsum, qabs = _quest_query(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
        _score_candidates(s * CT + tl.arange(0, CT), nc, kg_ptr, kmin_ptr, kmax_ptr, pages_ptr, held_ptr,
                          cs_ptr, ci_ptr, row, b, h, P, PG, C, s_end, l_start, margin, qsum, qabs,
                          stride_mn, stride_mh, stride_pb, D, D_PAD, GP, HAS_HELD)
    tl.debug_barrier()
    if tl.atomic_add(tick_ptr + row, 1, sem="acq_rel") == S - 1:
        budget = _middle_budget(bud_ptr, dense_ptr, row, s_end, l_start, HKV, HAS_DENSE)
        _write_top(cs_ptr, ci_ptr, want_ptr, count_ptr, row, nc, n, s_end, l_start, budget, C, W,
                   C_PAD, C_TAIL, E_PAD, TILE)
        tl.store(tick_ptr + row, 0)
