"""The GPU buffer's lookup for one layer: selected pages -> slots, misses -> LRU victims.

    slots, miss_dst, miss = buffer_lookup(res_page, res_slot, last_use, rows, layer, want,
                                          now, counters, num_buckets=64, reuse=True, res_col=res_col)

Shapes (``spin_cluster.kvcache.buffer`` owns the policy and documents it):

    res_page, res_slot, last_use : [R, L, Hkv, C] int32   each request row's share, per layer
                                                          and head: page held, slot id, last use
    res_col  : [R, L, Hkv, P] int16  each share's page -> column map (-1: not held), kept in
                            step with res_page (``page_columns`` builds it)
    rows     : [B] int64    the decode rows
    want     : [B, Hkv, K]  int logical pages selected this step, -1 padding (distinct per head)
    counters : [4] int64    += lookups, hits, misses, evictions (of every row but
                            ``uncounted_row``, an optional keyword: a padding row's)
    now      : int, or a 1-element int tensor on want's device (the step index; a tensor
               lets a captured CUDA graph read each step's value)
    returns  slots [B, Hkv, K] int32 (0 where invalid), miss_dst [B*Hkv*K] int64 (slot to
             fill, -1 where no miss), miss [B, Hkv, K] bool; res_page, last_use and res_col of
             the rows' layer are updated in place.

A hit keeps its column; the i-th miss of a head takes the i-th victim column of the bucketed
LRU (``bucketed_lru``) among the columns not selected this step. ``reuse=False``
treats every held page as forgotten (every selected page is a miss).

Two implementations with the same contract: the Triton kernel (one launch: one program per
(row, head); CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and
``buffer_lookup_ref`` (fixed-shape torch ops, about 60 per call; ``res_col`` optional).
``buffer_lookup(..., impl="auto")`` picks one (``kernels._impl``: the kernel on CUDA). The
Triton launch finds hits through the map and walks columns in chunks of ``CHUNK`` and
selected pages in one chunk of up to 1024, O(K + C) per head (O(K) for a head without a miss)
at any width: per-head budgets of 500+ pages and shares of 1000+ columns are what S-HPLB gives
its widest heads.
Neither syncs with the host. This module imports only torch (and Triton, lazily).

A decode layer's whole page resolution, in the same one launch::

    slots, miss_dst, src, lens, tail_slot = resolve_selected(res_page, res_slot, last_use, rows,
        layer, want, num_selected, tail_len, now, counters, homes, res_col=res_col)

    homes         HomeMap: the directory and where the GPU homes begin (``kvcache.homes``)
    num_selected  [B, Hkv] int   valid entries per head (>= 1: the tail page, last)
    tail_len      [B] int        tokens in each request's tail page (1..S)
    returns  slots [B, Hkv, K] int32   every selected page's slot: a GPU home page's own slot
                                       (read in place; the share never sees it), else the
                                       buffer's, as ``buffer_lookup``
             miss_dst [B*Hkv*K] int64  as ``buffer_lookup``
             src [B*Hkv*K] int64       each miss's host page (Retrieve's sources), -1 elsewhere
             lens [B, Hkv] int32       tokens each head attends: (num_selected - 1) * S + tail_len
             tail_slot [B*Hkv] int64   flat slot of each head's newest token (the write-through)
    and each selected GPU home's segment stamped with ``now`` in homes.gpu_last_use (the spill
    order). ``resolve_selected_ref`` is the same in torch ops: the directory lookup, the tier
    test, the stamp, ``buffer_lookup_ref``, then the epilogue's outputs (``_epilogue_ref``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._impl import resolve_impl
from ._triton_support import is_interpreted, load_kernel_module, next_pow2
from .bucketed_lru import _check_row_value, bucketed_lru_victims_ref

__all__ = ["HomeMap", "buffer_lookup", "buffer_lookup_ref", "page_columns", "resident_pages", "resident_pages_ref",
           "resolve_selected", "resolve_selected_ref", "with_gpu_homes"]

CHUNK = 256  # columns (and at least as many selected pages) per chunk of the kernel
WARPS = 4  # warps per program


def buffer_lookup(res_page, res_slot, last_use, rows, layer: int, want, now: int, counters,
                  num_buckets: int = 64, reuse: bool = True, *, res_col, chunk: int = 0, col_chunk: int = 0,
                  warps: int = 0, impl: str = "auto", uncounted_row: int = -1):
    """``chunk``: columns and selected pages at a time (power of 2 >= 16; default ``CHUNK``;
    the kernel's only); ``col_chunk``: columns at a time alone (selected pages as by default);
    ``warps``: per program (default ``WARPS``; the kernel's only).
    ``impl``: "auto", "triton" or "torch" (``kernels._impl``)."""
    if resolve_impl(impl, want.device) == "torch":
        return buffer_lookup_ref(res_page, res_slot, last_use, rows, layer, want, now, counters,
                                 num_buckets, reuse, res_col, uncounted_row)
    slots, miss_dst, miss = _launch(res_page, res_slot, last_use, rows, layer, want, now, counters, num_buckets,
                                    reuse, res_col, chunk, col_chunk, warps, uncounted_row=uncounted_row)
    return slots, miss_dst, miss.bool()


def _launch(res_page, res_slot, last_use, rows, layer, want, now, counters, num_buckets, reuse, res_col,
            chunk, col_chunk, warps, resolve=None, uncounted_row=-1):
    """The kernel's one launch; ``resolve``: (homes, num_selected, tail_len) for
    ``resolve_selected``. Returns slots, miss_dst, miss (int8) and (resolve) src, lens, tail_slot."""
    _check(res_page, res_slot, last_use, rows, want, counters, now)
    kmod = load_kernel_module("_buffer_lookup_kernel", "buffer_lookup", "buffer_lookup_ref")
    if want.device.type != "cuda" and not is_interpreted(kmod._buffer_lookup):
        raise ValueError("the Triton buffer lookup needs CUDA tensors (or TRITON_INTERPRET=1); use buffer_lookup_ref")
    B, H, K = want.shape
    C = res_page.shape[-1]
    _check_map(res_col, res_page)
    now_from_ptr = isinstance(now, torch.Tensor)
    want = want.contiguous()  # any integer dtype: the kernel loads it as int32
    dev = want.device
    slots = torch.empty(B, H, K, dtype=torch.int32, device=dev)
    miss_dst = torch.empty(B * H * K, dtype=torch.int64, device=dev)
    miss = torch.empty(B, H, K, dtype=torch.int8, device=dev)
    if resolve is None:
        outs = ()
        dir_args = (counters, 0, 0, 0, 0, 0, counters, counters, counters, counters, counters, counters)
    else:
        homes, num_selected, tail_len = resolve
        src = torch.empty(B * H * K, dtype=torch.int64, device=dev)
        lens = torch.empty(B, H, dtype=torch.int32, device=dev)
        tail_slot = torch.empty(B * H, dtype=torch.int64, device=dev)
        d = homes.directory
        stamp = homes.gpu_last_use if homes.gpu_last_use is not None else counters
        dir_args = (d, d.stride(0), d.stride(1), d.stride(2), homes.first_gpu_segment, homes.gpu_slot_offset, stamp,
                    num_selected.contiguous(), tail_len.contiguous(), src, lens, tail_slot)
        outs = (src, lens, tail_slot)
    if not B * H:
        return (slots, miss_dst, miss) + outs
    # Selected pages go in one chunk when they fit 1024 (each chunk is a round trip to memory
    # through the page map: with 500+ pages in chunks of 64 the walk was latency-bound);
    # columns in chunks of CHUNK (a head with a miss walks its share twice, chunk by chunk).
    kb = chunk or min(1024, max(CHUNK, next_pow2(K)))
    chunk = col_chunk or chunk or CHUNK
    # Scratch rows of each (request, head): column state, selection state, victim columns.
    scratch = torch.empty(3, B * H, max(K, C), dtype=torch.int32, device=dev)
    kmod._buffer_lookup[(B * H,)](
        want, rows.contiguous(), res_page, res_slot, last_use, res_col, slots, miss_dst, miss, counters,
        scratch[0], scratch[1], scratch[2], now if now_from_ptr else counters, 0 if now_from_ptr else int(now),
        int(layer), res_page.stride(0), res_page.stride(1), res_page.stride(2),
        res_col.stride(0), res_col.stride(1), res_col.stride(2), K, C, H, *dir_args, int(uncounted_row),
        NUM_BUCKETS=num_buckets, KB=kb, CB=chunk, NKC=-(-K // kb), NCC=-(-C // chunk),
        NB_PAD=max(16, next_pow2(num_buckets)), REUSE=reuse, NOW_FROM_PTR=now_from_ptr,
        RESOLVE=resolve is not None, HOMES=resolve is not None and resolve[0].gpu_last_use is not None,
        SEGMENT_PAGES=resolve[0].segment_pages if resolve else 1, PAGE_SIZE=resolve[0].page_size if resolve else 1,
        num_warps=warps or WARPS,
    )
    return (slots, miss_dst, miss) + outs


@dataclass(frozen=True)
class HomeMap:
    """Where each selected page lives, for ``resolve_selected`` (``spin_cluster.kvcache.homes``
    and ``directory`` own the layout): page id = directory[row, layer, head, p // E] * E + p % E."""

    directory: torch.Tensor  # [R, L, Hkv, n_seg] int32 segment ids (-1: none), last dim contiguous
    segment_pages: int  # E
    page_size: int  # S
    first_gpu_segment: int  # segment ids from here on are GPU homes
    gpu_slot_offset: int  # a GPU home page id + this = its slot in the page array
    gpu_last_use: torch.Tensor | None  # [Ng + 1] int32 step of each GPU segment's last pick; None: no GPU homes


def resolve_selected(res_page, res_slot, last_use, rows, layer: int, want, num_selected, tail_len, now, counters,
                     homes: HomeMap, num_buckets: int = 64, reuse: bool = True, *, res_col, chunk: int = 0,
                     col_chunk: int = 0, warps: int = 0, impl: str = "auto", uncounted_row: int = -1):
    """The module docstring's second contract; arguments as ``buffer_lookup``'s."""
    _check_resolve(want, num_selected, rows, tail_len, homes)
    if resolve_impl(impl, want.device) == "torch":
        return resolve_selected_ref(res_page, res_slot, last_use, rows, layer, want, num_selected, tail_len, now,
                                    counters, homes, num_buckets, reuse, res_col, uncounted_row)
    slots, miss_dst, _, src, lens, tail_slot = _launch(
        res_page, res_slot, last_use, rows, layer, want, now, counters, num_buckets, reuse, res_col, chunk,
        col_chunk, warps, resolve=(homes, num_selected, tail_len), uncounted_row=uncounted_row)
    return slots, miss_dst, src, lens, tail_slot


def resolve_selected_ref(res_page, res_slot, last_use, rows, layer: int, want, num_selected, tail_len, now,
                         counters, homes: HomeMap, num_buckets: int = 64, reuse: bool = True, res_col=None,
                         uncounted_row: int = -1):
    _check_resolve(want, num_selected, rows, tail_len, homes)
    E = homes.segment_pages
    safe = want.clamp(min=0).long()
    seg = homes.directory[rows, layer].gather(2, safe // E).long()  # [B, Hkv, K] each selected page's segment
    at_home = None
    if homes.gpu_last_use is not None:  # GPU home pages are read in place; the share sees host pages only
        home = (want >= 0) & (seg >= homes.first_gpu_segment)
        at_home = torch.where(home, seg * E + safe % E + homes.gpu_slot_offset, -1)
        spare = homes.gpu_last_use.shape[0] - 1  # takes the stamps of host pages and padding
        stamp = torch.where(home, seg - homes.first_gpu_segment, spare).reshape(-1)
        now_t = now.reshape(()) if isinstance(now, torch.Tensor) else torch.tensor(now, device=want.device)
        homes.gpu_last_use.index_copy_(0, stamp, now_t.to(torch.int32).expand(stamp.numel()))
        want = torch.where(home, -1, want)
    slots, miss_dst, miss = buffer_lookup_ref(res_page, res_slot, last_use, rows, layer, want, now, counters,
                                              num_buckets, reuse, res_col, uncounted_row)
    if at_home is not None:
        slots = torch.where(at_home >= 0, at_home, slots).int()
    src, lens, tail_slot = _epilogue_ref(want, seg * E + safe % E, slots, miss, num_selected, tail_len,
                                         homes.page_size)
    return slots, miss_dst, src, lens, tail_slot


def _epilogue_ref(want, pages, slots, miss, num_selected, tail_len, S: int):
    """The misses' host pages (``pages``: each selected page's home page id), each head's
    attended length and its newest token's flat slot (the slot of its last selected page, the
    tail, * S + tail_len - 1)."""
    src = torch.where(miss & (want >= 0), pages, -1).view(-1)
    tail = tail_len.long()[:, None]  # [B, 1]
    last = slots.gather(-1, (num_selected.long() - 1).clamp(min=0)[..., None])[..., 0].long()  # [B, Hkv]
    lens = ((num_selected.long() - 1) * S + tail).to(torch.int32)
    return src, lens, (last * S + tail - 1).reshape(-1)


def resident_pages(res_col, rows, layer: int, num_pages: int, homes: HomeMap | None = None, *, impl: str = "auto"):
    """[B, Hkv, num_pages] bool: which of pages 0 .. num_pages - 1 of each head of ``rows`` [B]
    a step reads without a transfer: held by the share (res_col, as ``buffer_lookup``'s) or,
    with ``homes`` that have GPU homes, at home on the GPU. Select's hysteresis leans towards
    them. One launch (about eight torch kernels in ``resident_pages_ref``); no host sync."""
    if resolve_impl(impl, rows.device) == "torch":
        return resident_pages_ref(res_col, rows, layer, num_pages, homes)
    kmod = load_kernel_module("_buffer_lookup_kernel", "resident_pages", "resident_pages_ref")
    if rows.device.type != "cuda" and not is_interpreted(kmod._resident_pages):
        raise ValueError("the Triton resident pages need CUDA tensors (or TRITON_INTERPRET=1); use resident_pages_ref")
    if res_col.dim() != 4 or res_col.dtype != torch.int16 or not res_col.is_contiguous():
        raise ValueError(f"res_col must be a contiguous [R, L, Hkv, P] int16 map; got {tuple(res_col.shape)} {res_col.dtype}")
    B, H = rows.shape[0], res_col.shape[2]
    out = torch.empty(B, H, num_pages, dtype=torch.int8, device=rows.device)
    with_homes = homes is not None and homes.gpu_last_use is not None
    d = homes.directory if with_homes else res_col
    block = min(1024, max(16, next_pow2(num_pages)))
    if B * H and num_pages:
        kmod._resident_pages[(B * H, -(-num_pages // block))](
            res_col, rows.contiguous(), d, out, int(layer), num_pages, res_col.stride(0), res_col.stride(1),
            res_col.stride(2), d.stride(0), d.stride(1), d.stride(2), homes.first_gpu_segment if with_homes else 0, H,
            HOMES=with_homes, SEGMENT_PAGES=homes.segment_pages if with_homes else 1, BLOCK=block, num_warps=4,
        )
    return out.view(torch.bool)


def resident_pages_ref(res_col, rows, layer: int, num_pages: int, homes: HomeMap | None = None):
    return with_gpu_homes(res_col[rows, layer, :, :num_pages] >= 0, rows, layer, homes)


def with_gpu_homes(held, rows, layer: int, homes: HomeMap | None):
    """held [B, Hkv, P] bool (pages 0 .. P - 1 of ``rows`` [B]), or-ed with which of them live
    at home on the GPU where ``homes`` has GPU homes; else held as it is. Torch ops, no sync."""
    if homes is None or homes.gpu_last_use is None:
        return held
    logical = torch.arange(held.shape[-1], device=held.device) // homes.segment_pages
    return held | (homes.directory[rows, layer][..., logical] >= homes.first_gpu_segment)


def _check_resolve(want, num_selected, rows, tail_len, homes: HomeMap) -> None:
    B, H, _ = want.shape
    if tuple(num_selected.shape) != (B, H) or tuple(tail_len.shape) != (B,):
        raise ValueError(f"num_selected must be [B, Hkv] = [{B}, {H}] and tail_len [B]; got "
                         f"{tuple(num_selected.shape)} and {tuple(tail_len.shape)}")
    d = homes.directory
    if d.dim() != 4 or d.shape[2] != H or d.stride(3) != 1 or d.dtype != torch.int32:
        raise ValueError(f"the directory must be [R, L, {H}, n_seg] int32, contiguous in its last dimension")
    g = homes.gpu_last_use
    if g is not None and (g.dim() != 1 or g.dtype != torch.int32 or g.shape[0] < 1):
        raise ValueError("gpu_last_use must be [Ng + 1] int32")


def page_columns(res_page: torch.Tensor, num_pages: int) -> torch.Tensor:
    """The page -> column map of shares [.., C] (res_page): [.., num_pages] int16, -1 where
    a page is not held."""
    C = res_page.shape[-1]
    out = torch.full((*res_page.shape[:-1], num_pages + 1), -1, dtype=torch.int16, device=res_page.device)
    cols = torch.arange(C, dtype=torch.int16, device=res_page.device).expand_as(res_page)
    out.scatter_(-1, torch.where(res_page >= 0, res_page.long(), num_pages), cols)
    return out[..., :num_pages].contiguous()


def _check_map(res_col, res_page):
    if res_col.dim() != 4 or res_col.shape[:3] != res_page.shape[:3] or res_col.dtype != torch.int16:
        raise ValueError(f"res_col must be [R, L, Hkv, P] int16 like res_page's first dims; got "
                         f"{tuple(res_col.shape)} {res_col.dtype}")
    if not res_col.is_contiguous():
        raise ValueError("res_col must be contiguous")
    if res_page.shape[-1] > 32767:
        raise ValueError("shares wider than 32767 columns do not fit the int16 map")


def buffer_lookup_ref(res_page, res_slot, last_use, rows, layer: int, want, now: int, counters,
                      num_buckets: int = 64, reuse: bool = True, res_col=None, uncounted_row: int = -1):
    _check(res_page, res_slot, last_use, rows, want, counters, now)
    B, Hkv, K = want.shape
    C = res_page.shape[-1]
    page = res_page[rows, layer]  # [B, Hkv, C]
    if not reuse:
        page = torch.full_like(page, -1)
    slot = res_slot[rows, layer]  # [B, Hkv, C]
    last = last_use[rows, layer]  # [B, Hkv, C]
    valid = want >= 0  # [B, Hkv, K]
    match = (want[..., :, None] == page[..., None, :]) & valid[..., None]  # [B, Hkv, K, C]
    hit = match.any(-1)  # [B, Hkv, K]
    hit_col = match.to(torch.int8).argmax(-1)  # [B, Hkv, K]
    miss = valid & ~hit
    protected = match.any(-2)  # [B, Hkv, C] columns selected this step
    evictable = (slot >= 0) & ~protected
    victims, _ = bucketed_lru_victims_ref(
        last.view(B * Hkv, C), evictable.view(B * Hkv, C), now, miss.sum(-1).view(-1), num_buckets,
    )
    victims = victims.view(B, Hkv, C)
    # The i-th miss of a head takes the i-th victim column of that head.
    miss_rank = miss.cumsum(-1) - 1  # [B, Hkv, K]
    victim_rank = victims.cumsum(-1) - 1  # [B, Hkv, C]
    rank_to_col = torch.zeros(B, Hkv, K + 1, dtype=torch.long, device=want.device)
    cols = torch.arange(C, device=want.device).expand(B, Hkv, C)
    rank_to_col.scatter_(-1, torch.where(victims, victim_rank, K).clamp(max=K), cols)
    miss_col = rank_to_col.gather(-1, miss_rank.clamp(min=0))
    col = torch.where(hit, hit_col.long(), torch.where(miss, miss_col, 0))  # [B, Hkv, K]
    slots = slot.gather(-1, col)  # [B, Hkv, K]
    # Update the share: misses now hold their page; every selected column was used now.
    res_page[rows, layer] = _scatter_masked(page, col, want.int(), miss)
    now_t = now.reshape(()).to(torch.int32) if isinstance(now, torch.Tensor) else torch.tensor(now, dtype=torch.int32)
    last_use[rows, layer] = _scatter_masked(last, col, now_t.to(want.device).expand(want.shape), valid)
    if res_col is not None and reuse:  # the map follows the shares
        _check_map(res_col, res_page)
        res_col[rows, layer] = page_columns(res_page[rows, layer], res_col.shape[-1])
    counted = (rows != uncounted_row)[:, None, None]  # [B, 1, 1]
    evicted = (victims & (page >= 0) & counted).sum()
    counters += torch.stack([(valid & counted).sum(), (hit & counted).sum(), (miss & counted).sum(), evicted])
    return torch.where(valid, slots, 0).int(), torch.where(miss, slots.long(), -1).view(-1), miss


def _scatter_masked(base: torch.Tensor, col: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """base [.., C] with base[.., col[k]] = values[k] where mask[k]; other entries kept."""
    C = base.shape[-1]
    padded = torch.nn.functional.pad(base, (0, 1))  # extra column C swallows masked-off writes
    padded.scatter_(-1, torch.where(mask, col, C), values.to(base.dtype))
    return padded[..., :C]


def _check(res_page, res_slot, last_use, rows, want, counters, now) -> None:
    if res_page.dim() != 4 or res_slot.shape != res_page.shape or last_use.shape != res_page.shape:
        raise ValueError("res_page, res_slot and last_use must be [R, L, Hkv, C] alike")
    if not (res_page.is_contiguous() and res_slot.is_contiguous() and last_use.is_contiguous()):
        raise ValueError("res_page, res_slot and last_use must be contiguous")
    if want.dim() != 3 or want.shape[1] != res_page.shape[2] or rows.shape != want.shape[:1]:
        raise ValueError(f"want must be [B, Hkv, K] and rows [B]; got {tuple(want.shape)} and {tuple(rows.shape)}")
    if counters.shape != (4,) or counters.dtype != torch.int64:
        raise ValueError("counters must be a [4] int64 tensor")
    _check_row_value(now, "now", 1, want.device)
