"""Triton body of Retrieve (see ``retrieve.py`` for the launcher).

Importing this module needs Triton. ``retrieve.py`` imports it lazily, so the pure-torch
reference works without Triton.

``_retrieve_pages``
    grid ``(R + cdiv(M, PAIRS),)`` (R write-through rows, below). Pair program ``p`` copies, for
    each of its pairs ``i`` (``p * PAIRS`` to ``p * PAIRS + PAIRS - 1``, one after another), the
    K page and the V page::

        src_k[src_ids[i]] -> dst_k[dst_ids[i]]      src_v[src_ids[i]] -> dst_v[dst_ids[i]]

    A page is ``PAGE_NUMEL = S * D`` contiguous elements, copied as flat chunks of ``BLOCK``
    elements (``BLOCK`` a power of two, ``NUM_CHUNKS * BLOCK >= PAGE_NUMEL``). Every load of a
    chunk is issued before its stores, K and V together, so that each program keeps two
    chunks in flight: reads from pinned host memory cross PCIe with microseconds of latency,
    and only many outstanding requests hide it.

    A pair is live iff ``i < M``, ``i < count`` (when ``HAS_COUNT``) and both ids are ``>= 0``;
    a dead pair's loads and stores are masked off, so it moves no bytes. ``count`` is read on
    the device: the launcher never learns it.

    PAIRS > 1 when M is large: a decode step's pairs are one per (row, selected page), about
    17K at 4 x 128K (Llama-3.1-8B shapes), all dead when the pages are at home on the GPU. On
    an H200 one program per pair took 12 us a layer to move nothing, 16 pairs a program 9 us:
    the launch's size is not most of that cost.

Write-through rows (``ROWS``): k, v [R, D] for flat token slots [R] (page * S + offset, < 0:
none) of the destination, landing after the pages: a decode token's new row must win over its
tail page's copy (with FP8 host pages that copy's row is the host's quantised one, the new row
exact). Programs of one launch are not ordered, so each row has exactly one writer instead.
The pairs come in R groups of G = M / R (a head's K selected pages), and a row's slot lies in
no other group's destination pages::

    grid:  | row programs: R            | pair programs: cdiv(M, PAIRS)                   |
    pairs: |                            | group 0: 0 .. G-1 | group 1: G .. 2G-1 | ...    |
             row r, unless a live pair    a live pair whose destination page holds its
             of group r copies into its   group's row slot: the page copied with the row
             slot's page (a hit)          in place of its host row (a miss)

Each element is stored once, so no barrier or ordering is needed. The row programs come
first: the interpreter runs programs in order, so a row stored before its page's copy would
show in the tests.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_pairs(src_ids_ptr, dst_ids_ptr, n, p, PAIRS: tl.constexpr):
    """(js, srcs, dsts, lives) [PAIRS]: pair program p's pairs of the first n, their ids in one
    load each, so that a program of dead pairs waits on memory once (scalar loads pair by pair
    waited PAIRS times: 9 us a layer of no bytes at 4 x 128K), and which of them are live."""
    js = tl.arange(0, PAIRS)
    at = p * PAIRS + js
    srcs = tl.load(src_ids_ptr + at, mask=at < n, other=-1).to(tl.int64)
    dsts = tl.load(dst_ids_ptr + at, mask=at < n, other=-1).to(tl.int64)
    return js, srcs, dsts, (srcs >= 0) & (dsts >= 0)


@triton.jit
def _pair_value(js, j, x):
    """Element j of the program's [PAIRS] vector x, as a scalar."""
    return tl.sum(tl.where(js == j, x, 0), 0)


@triton.jit
def _pairs_and_rows(src_ids_ptr, dst_ids_ptr, row_slots_ptr, n, p, group, S: tl.constexpr, PAIRS: tl.constexpr,
                    ROWS: tl.constexpr):
    """``_program_pairs``' (js, srcs, dsts, lives), then (rows, row_offs) [PAIRS]: each pair's
    group (the row it may carry) and, with ROWS, where the pair is live and its destination
    page holds that row's slot, the row's offset in the page (else -1)."""
    js, srcs, dsts, lives = _program_pairs(src_ids_ptr, dst_ids_ptr, n, p, PAIRS)
    rows = (p * PAIRS + js) // group
    row_offs = tl.full([PAIRS], -1, tl.int64)
    if ROWS:
        slots = tl.load(row_slots_ptr + rows, mask=lives, other=-1).to(tl.int64)
        holds = lives & (slots >= 0) & (dsts == tl.maximum(slots, 0) // S)
        row_offs = tl.where(holds, slots % S, -1)
    return js, srcs, dsts, lives, rows, row_offs


@triton.jit
def _write_row_unless_copied(k_rows, v_rows, row_slots_ptr, stride_rk, stride_rv, dst_k, dst_v, stride_dst_k,
                             stride_dst_v, src_ids_ptr, dst_ids_ptr, n, group, r, S: tl.constexpr,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                             GROUP_CHUNKS: tl.constexpr):
    """Row r into its slot, unless a live pair of group r copies the slot's page (that pair's
    program writes the row with the page)."""
    slot = tl.load(row_slots_ptr + r).to(tl.int64)
    page = tl.maximum(slot, 0) // S
    gs = tl.arange(0, BLOCK_G)
    copies = tl.zeros([BLOCK_G], tl.int32)
    for c in tl.static_range(GROUP_CHUNKS):
        at = r * group + c * BLOCK_G + gs
        m = (c * BLOCK_G + gs < group) & (at < n)
        srcs = tl.load(src_ids_ptr + at, mask=m, other=-1)
        dsts = tl.load(dst_ids_ptr + at, mask=m, other=-1).to(tl.int64)
        copies += ((srcs >= 0) & (dsts == page)).to(tl.int32)
    if (slot >= 0) & (tl.sum(copies, 0) == 0):
        offs = tl.arange(0, BLOCK_D)
        in_d = offs < D
        at_k = dst_k + page * stride_dst_k + (slot % S) * D + offs
        at_v = dst_v + page * stride_dst_v + (slot % S) * D + offs
        tl.store(at_k, tl.load(k_rows + r * stride_rk + offs, mask=in_d), mask=in_d)
        tl.store(at_v, tl.load(v_rows + r * stride_rv + offs, mask=in_d), mask=in_d)


@triton.jit
def _retrieve_pages(
    src_k_ptr,
    src_v_ptr,
    dst_k_ptr,
    dst_v_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    count_ptr,
    M,
    stride_src_k,  # elements between pages, per tensor
    stride_src_v,
    stride_dst_k,
    stride_dst_v,
    k_rows,  # the write-through rows (with ROWS; else unused)
    v_rows,
    row_slots_ptr,
    stride_rk,
    stride_rv,
    group,  # pairs per row: G = M / R
    num_rows,  # R: the row programs come first (0 without ROWS)
    PAGE_NUMEL: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    PAIRS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_CHUNKS: tl.constexpr,
):
    n = M
    if HAS_COUNT:
        n = tl.minimum(n, tl.load(count_ptr))
    pid = tl.program_id(0)
    if pid >= num_rows:
        js, srcs, dsts, lives, rows, row_offs = _pairs_and_rows(src_ids_ptr, dst_ids_ptr, row_slots_ptr, n,
                                                                pid - num_rows, group, S, PAIRS, ROWS)
        offs = tl.arange(0, BLOCK)
        if tl.max(lives.to(tl.int32), 0) > 0:
            for j in tl.static_range(PAIRS):
                src = _pair_value(js, j, srcs)
                dst = _pair_value(js, j, dsts)
                live = _pair_value(js, j, lives.to(tl.int32)) > 0
                if ROWS:
                    row = _pair_value(js, j, rows)
                    row_start = _pair_value(js, j, row_offs) * D  # < 0: the page carries no row
                src_k_page = src_k_ptr + src * stride_src_k
                src_v_page = src_v_ptr + src * stride_src_v
                dst_k_page = dst_k_ptr + dst * stride_dst_k
                dst_v_page = dst_v_ptr + dst * stride_dst_v
                for c in tl.static_range(NUM_CHUNKS):
                    o = c * BLOCK + offs
                    if PAGE_NUMEL % BLOCK == 0:
                        mask = live  # a scalar mask keeps the loads at full vector width
                    else:
                        mask = live & (o < PAGE_NUMEL)
                    k = tl.load(src_k_page + o, mask=mask)
                    v = tl.load(src_v_page + o, mask=mask)
                    if ROWS:
                        if row_start >= 0:
                            at = o - row_start
                            in_row = (at >= 0) & (at < D)
                            k = tl.where(in_row, tl.load(k_rows + row * stride_rk + at, mask=in_row), k)
                            v = tl.where(in_row, tl.load(v_rows + row * stride_rv + at, mask=in_row), v)
                    tl.store(dst_k_page + o, k, mask=mask)
                    tl.store(dst_v_page + o, v, mask=mask)
    elif ROWS:
        _write_row_unless_copied(k_rows, v_rows, row_slots_ptr, stride_rk, stride_rv, dst_k_ptr, dst_v_ptr,
                                 stride_dst_k, stride_dst_v, src_ids_ptr, dst_ids_ptr, n, group,
                                 pid, S, D, BLOCK_D, BLOCK_G, GROUP_CHUNKS)
