"""Triton bodies of ``radix_select.py`` (launcher, contract and the reasons live there).

A row's keys are its middle pages' scores as unsigned 32-bit keys of the same order
(``_page_select_kernel._sortable`` + 2^31). The threshold's top 12 bits come from a histogram
that every chunk of the row adds to; its low 20 bits from the few keys that share those 12.
"""

import triton
import triton.language as tl

from ._page_select_kernel import _digit_at, _edges, _sortable

# A row's histogram is hist[row, 0:4096], its candidate count hist[row, 4096] and the chunks of
# pass 2 that have finished hist[row, 4097] (one zeroed buffer).


@triton.jit
def _chunk_keys(s_ptr, n_ptr, row, t, P, SINK, LOCAL, HKV: tl.constexpr, CH: tl.constexpr):
    """(page ids [CH], unsigned keys [CH] int64, valid [CH]) of chunk t of a row: valid where
    the page is a middle page of its request's context with a score above -inf."""
    n = tl.load(n_ptr + row // HKV)
    s_end, l_start = _edges(n, SINK, LOCAL)
    offs = t * CH + tl.arange(0, CH)
    x = tl.load(s_ptr + row * P + offs, mask=offs < P, other=float("-inf"))
    valid = (offs >= s_end) & (offs < l_start) & (x > float("-inf"))
    return offs, _sortable(x) + 2147483648, valid


@triton.jit
def _first_digit(hist_ptr, bud_ptr, row):
    """(budget, d, above) of a row from its first-digit histogram: the budget capped at the
    row's valid keys, the threshold's first digit d (the largest bin with at least budget keys
    at or above it; 4096 when the budget is 0), and how many keys lie above bin d."""
    bins = tl.arange(0, 4096)
    hist = tl.load(hist_ptr + row * 4098 + bins)
    budget = tl.minimum(tl.load(bud_ptr + row).to(tl.int32), tl.sum(hist, 0))
    d, rest = _digit_at(hist, bins, budget)
    return budget, tl.where(budget > 0, d, 4096), budget - rest


@triton.jit(do_not_specialize=["P"])
def _radix_hist(s_ptr, n_ptr, hist_ptr, P, SINK, LOCAL, HKV: tl.constexpr, CH: tl.constexpr):
    """Pass 1, grid (rows, chunks): the chunk's first digits added to its row's histogram."""
    row = tl.program_id(0).to(tl.int64)
    _, ukey, valid = _chunk_keys(s_ptr, n_ptr, row, tl.program_id(1), P, SINK, LOCAL, HKV, CH)
    digit = (ukey >> 20).to(tl.int32)
    h = tl.histogram(digit, 4096, mask=valid)
    bins = tl.arange(0, 4096)
    tl.atomic_add(hist_ptr + row * 4098 + bins, h, mask=h > 0)


@triton.jit
def _gather_chunk(s_ptr, n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, row, t, P, T, SINK, LOCAL,
                  HKV: tl.constexpr, CH: tl.constexpr):
    _, d, _ = _first_digit(hist_ptr, bud_ptr, row)
    offs, ukey, valid = _chunk_keys(s_ptr, n_ptr, row, t, P, SINK, LOCAL, HKV, CH)
    digit = (ukey >> 20).to(tl.int32)
    tl.store(above_ptr + row * T + t, tl.sum((valid & (digit > d)).to(tl.int32), 0))
    eq = valid & (digit == d)
    n_eq = tl.sum(eq.to(tl.int32), 0)
    base = tl.atomic_add(hist_ptr + row * 4098 + 4096, n_eq)
    at = row * P + base + tl.cumsum(eq.to(tl.int32), 0) - 1
    tl.store(ckey_ptr + at, ukey, mask=eq)
    tl.store(cidx_ptr + at, offs, mask=eq)


@triton.jit(do_not_specialize=["P", "T"])
def _radix_gather(s_ptr, n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, P, T, SINK, LOCAL,
                  HKV: tl.constexpr, CH: tl.constexpr):
    """Pass 2, grid (rows, chunks): keys above the threshold's first digit counted per chunk;
    keys in its bin appended to the row's candidates (count at hist[row, 4096])."""
    _gather_chunk(s_ptr, n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, tl.program_id(0).to(tl.int64),
                  tl.program_id(1), P, T, SINK, LOCAL, HKV, CH)


@triton.jit
def _low_digit(ckey_ptr, row, P, nc, prefix, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr):
    """One digit of the threshold below the first: WIDTH bits at SHIFT, from a histogram of
    the row's nc candidates that match the digits found so far (prefix); need: keys still to
    take at or below the digits found. Returns the new (prefix, need)."""
    bins = tl.arange(0, 256)
    tr = tl.arange(0, TILE)
    h = tl.zeros([256], tl.int32)
    i = nc * 0
    while i < nc:  # a loop bound read from memory (the interpreter's range() wants an int)
        m = i + tr < nc
        k = tl.load(ckey_ptr + row * P + i + tr, mask=m, other=0)
        match = (k >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH))
        h += tl.histogram(((k >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), 256, mask=m & match)
        i += TILE
    dd, need = _digit_at(h, bins, need)
    return prefix | (dd.to(tl.int64) << SHIFT), need


@triton.jit
def _resolve_row(n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr,
                 want_ptr, count_ptr, row, P, T, W, SINK, LOCAL,
                 HKV: tl.constexpr, CH: tl.constexpr, T_PAD: tl.constexpr, TILE: tl.constexpr, W_PAD: tl.constexpr):
    budget, d, above = _first_digit(hist_ptr, bud_ptr, row)
    nc = tl.load(hist_ptr + row * 4098 + 4096)
    need = budget - above  # keys still to take from bin d (>= 1 when budget > 0)
    prefix = d.to(tl.int64) << 20
    prefix, need = _low_digit(ckey_ptr, row, P, nc, prefix, need, 12, 8, TILE)
    prefix, need = _low_digit(ckey_ptr, row, P, nc, prefix, need, 4, 8, TILE)
    prefix, need = _low_digit(ckey_ptr, row, P, nc, prefix, need, 0, 4, TILE)
    lo = tl.where(budget > 0, prefix, 1 << 32)  # above every key: nothing taken
    take = tl.where(budget > 0, need, 0)  # keys equal to lo to take
    # Per chunk: candidates above lo and equal to it.
    tr = tl.arange(0, TILE)
    gt_c = tl.zeros([T_PAD], tl.int32)
    eq_c = tl.zeros([T_PAD], tl.int32)
    i = nc * 0
    while i < nc:
        m = i + tr < nc
        k = tl.load(ckey_ptr + row * P + i + tr, mask=m, other=0)
        c = tl.load(cidx_ptr + row * P + i + tr, mask=m, other=0) // CH
        gt_c += tl.histogram(c, T_PAD, mask=m & (k > lo))
        eq_c += tl.histogram(c, T_PAD, mask=m & (k == lo))
        i += TILE
    ts = tl.arange(0, T_PAD)
    gt_c += tl.load(above_ptr + row * T + ts, mask=ts < T, other=0)
    tie_before = tl.cumsum(eq_c, 0) - eq_c
    kept = gt_c + tl.minimum(tl.maximum(take - tie_before, 0), eq_c)
    tl.store(tie_ptr + row * T + ts, tie_before, mask=ts < T)
    tl.store(kept_ptr + row * T + ts, tl.cumsum(kept, 0) - kept, mask=ts < T)
    tl.store(lo_ptr + row, lo)
    tl.store(take_ptr + row, take)
    # sink pages at [0, s_end), local pages right after the budget's middle ones, then -1
    n = tl.load(n_ptr + row // HKV)
    s_end, l_start = _edges(n, SINK, LOCAL)
    offs_w = tl.arange(0, W_PAD)
    local_at = s_end + budget
    count = local_at + n - l_start
    page = tl.where(offs_w < s_end, offs_w, l_start + offs_w - local_at)
    edge = (offs_w < s_end) | ((offs_w >= local_at) & (offs_w < count))
    tl.store(want_ptr + row * W + offs_w, tl.where(edge, page, -1).to(tl.int64),
             mask=(offs_w < W) & (edge | (offs_w >= count)))
    tl.store(count_ptr + row, count.to(tl.int64))


@triton.jit(do_not_specialize=["P", "T", "W"])
def _radix_resolve(n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr,
                   want_ptr, count_ptr, P, T, W, SINK, LOCAL,
                   HKV: tl.constexpr, CH: tl.constexpr, T_PAD: tl.constexpr, TILE: tl.constexpr,
                   W_PAD: tl.constexpr):
    """Pass 3, grid (rows,): the threshold's low 20 bits from the row's candidates (three
    histogram passes over them: 8, 8 and 4 bits), how many keys equal to it the row takes
    (lowest page first), and per chunk the ties and the kept pages before it; the row's sink
    and local pages, its -1 padding and its count."""
    _resolve_row(n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr,
                 want_ptr, count_ptr, tl.program_id(0).to(tl.int64), P, T, W, SINK, LOCAL, HKV, CH, T_PAD, TILE, W_PAD)


@triton.jit
def _write_chunk(s_ptr, n_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr, want_ptr, row, t, P, T, W, SINK, LOCAL,
                 HKV: tl.constexpr, CH: tl.constexpr):
    offs, ukey, valid = _chunk_keys(s_ptr, n_ptr, row, t, P, SINK, LOCAL, HKV, CH)
    lo = tl.load(lo_ptr + row)
    eq = valid & (ukey == lo)
    eq_rank = tl.load(tie_ptr + row * T + t) + tl.cumsum(eq.to(tl.int32), 0)  # 1-based in the row
    keep = (valid & (ukey > lo)) | (eq & (eq_rank <= tl.load(take_ptr + row)))
    n = tl.load(n_ptr + row // HKV)
    s_end, _ = _edges(n, SINK, LOCAL)
    pos = s_end + tl.load(kept_ptr + row * T + t) + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(want_ptr + row * W + pos, offs.to(tl.int64), mask=keep & (pos < W))


@triton.jit(do_not_specialize=["P", "T", "W"])
def _radix_write(s_ptr, n_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr, want_ptr, P, T, W, SINK, LOCAL,
                 HKV: tl.constexpr, CH: tl.constexpr):
    """Pass 4, grid (rows, chunks): the chunk's kept middle pages, in page order, at their
    place in the row (after the sink pages and the earlier chunks' kept pages)."""
    _write_chunk(s_ptr, n_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr, want_ptr, tl.program_id(0).to(tl.int64),
                 tl.program_id(1), P, T, W, SINK, LOCAL, HKV, CH)


@triton.jit(do_not_specialize=["P", "T", "W"])
def _radix_gather_last(s_ptr, n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, lo_ptr, take_ptr, tie_ptr,
                       kept_ptr, want_ptr, count_ptr, P, T, W, SINK, LOCAL,
                       HKV: tl.constexpr, CH: tl.constexpr, T_PAD: tl.constexpr, TILE: tl.constexpr,
                       W_PAD: tl.constexpr):
    """Passes 2 to 4 in one launch, grid (rows, chunks): each program gathers its chunk (pass
    2); the last of a row's programs to finish (an acquire-release counter at hist[row, 4097],
    so it sees every other chunk's candidates) resolves the row (pass 3) and writes every
    chunk's kept pages (pass 4, chunk by chunk)."""
    row = tl.program_id(0).to(tl.int64)
    _gather_chunk(s_ptr, n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, row, tl.program_id(1), P, T,
                  SINK, LOCAL, HKV, CH)
    done = tl.atomic_add(hist_ptr + row * 4098 + 4097, 1, sem="acq_rel")
    if done == T - 1:
        _resolve_row(n_ptr, bud_ptr, hist_ptr, ckey_ptr, cidx_ptr, above_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr,
                     want_ptr, count_ptr, row, P, T, W, SINK, LOCAL, HKV, CH, T_PAD, TILE, W_PAD)
        tl.debug_barrier()  # the row's threshold and offsets, stored above, read by every thread below
        t = done * 0
        while t < T:
            _write_chunk(s_ptr, n_ptr, lo_ptr, take_ptr, tie_ptr, kept_ptr, want_ptr, row, t, P, T, W, SINK, LOCAL,
                         HKV, CH)
            t += 1
