"""Triton body of Retrieve (see ``retrieve.py`` for the launcher).

Importing this module needs Triton. ``retrieve.py`` imports it lazily, so the pure-torch
reference works without Triton.

``_retrieve_pages``
    grid ``(cdiv(M, PAIRS),)``. Program ``p`` copies, for each of its pairs ``i`` (``p * PAIRS``
    to ``p * PAIRS + PAIRS - 1``, one after another), the K page and the V page::

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
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_pairs(src_ids_ptr, dst_ids_ptr, n, PAIRS: tl.constexpr):
    """(js, srcs, dsts, lives) [PAIRS]: this program's pairs of the first n, their ids in one
    load each, so that a program of dead pairs waits on memory once (scalar loads pair by pair
    waited PAIRS times: 9 us a layer of no bytes at 4 x 128K), and which of them are live."""
    js = tl.arange(0, PAIRS)
    at = tl.program_id(0) * PAIRS + js
    srcs = tl.load(src_ids_ptr + at, mask=at < n, other=-1).to(tl.int64)
    dsts = tl.load(dst_ids_ptr + at, mask=at < n, other=-1).to(tl.int64)
    return js, srcs, dsts, (srcs >= 0) & (dsts >= 0)


@triton.jit
def _pair_value(js, j, x):
    """Element j of the program's [PAIRS] vector x, as a scalar."""
    return tl.sum(tl.where(js == j, x, 0), 0)


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
    PAGE_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    PAIRS: tl.constexpr,
):
    n = M
    if HAS_COUNT:
        n = tl.minimum(n, tl.load(count_ptr))
    js, srcs, dsts, lives = _program_pairs(src_ids_ptr, dst_ids_ptr, n, PAIRS)
    offs = tl.arange(0, BLOCK)
    if tl.max(lives.to(tl.int32), 0) > 0:
        for j in tl.static_range(PAIRS):
            src = _pair_value(js, j, srcs)
            dst = _pair_value(js, j, dsts)
            live = _pair_value(js, j, lives.to(tl.int32)) > 0
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
                tl.store(dst_k_page + o, k, mask=mask)
                tl.store(dst_v_page + o, v, mask=mask)
