"""Select's per-head top-k with a row spread over many programs: ``select_ragged``'s contract
(``page_select.py``) in four launches whose grids follow the row's length.

Why: ``select_ragged`` gives a (request, KV head) row to one program, which holds the row
padded to a power of two and runs four 8-bit radix passes over all of it. A decode step has
few rows (8 at one request of Llama-3.1-8B), so the step waits on one program's latency: on
the H200 about 50 us a layer at 128K tokens whatever the batch (``_select_ragged`` in
``benchmarks/results/profiles/2026-12-05-h200-profile-spin-128k-*``). The split-row Select
(``split_chunk``) spreads a row only when budgets are narrow: a chunk keeps up to a budget of
candidates, and S-HPLB's widest heads take ~540 pages. Here no pass holds a whole row:

    pass 1  grid (rows, chunks)  every chunk adds its keys' top 12 bits to the row's 4096-bin
                                 histogram (atomics)
    pass 2  grid (rows, chunks)  the threshold's first digit d from the histogram (every
                                 program reads it); keys above bin d counted per chunk, keys in
                                 bin d appended to the row's candidates
    pass 3  grid (rows,)         the threshold's other 20 bits from the candidates alone (three
                                 histogram passes over them), the ties to take (lowest page
                                 first), each chunk's place in the output; sink and local pages
    pass 4  grid (rows, chunks)  each chunk writes its kept pages in page order

With ``fused=True`` passes 2 to 4 are one launch: the last of a row's pass-2 programs to
finish (an acquire-release counter) resolves the row and writes its chunks one by one; two
launches and a memset a layer, as many as the whole-row Select and its scores.

A key is a score's float32 bits in an order-keeping unsigned form, so the threshold is exact
and the pages are ``select_ragged_ref``'s, tie rule included (tested equal). Pass 3 reads only
the keys that share the threshold's top 12 bits (the sign, the exponent and 3 bits of the
mantissa): a row's budget lies in one such bin. No host sync; shapes come from the arguments
(CUDA-graph safe). Not chosen by the engine: on an H100 (``docs/performance.md``, 2026-12-06)
it took 43-62 us a layer at 128K against the whole-row kernel's 24-40 and the split-row
kernel's 18 (fused, 43-90): the atomics and the launches cost more than the row's latency
they spread.
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module, next_pow2
from .page_select import _check_select, select_ragged_ref

__all__ = ["RADIX_CHUNK", "select_ragged_radix"]

RADIX_CHUNK = 1024  # pages per program of passes 1, 2 and 4
_TILE = 1024  # candidates per iteration of pass 3


def select_ragged_radix(scores: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, local_pages: int,
                        budgets: torch.Tensor, width: int, chunk: int = RADIX_CHUNK, fused: bool = False, *,
                        impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``select_ragged`` (same arguments, same result) in the passes above. ``chunk``: pages
    per program (a power of two >= 16); ``fused``: passes 2-4 in one launch. "auto" takes the
    reference off CUDA."""
    if resolve_impl(impl, scores.device) == "torch":
        return select_ragged_ref(scores, num_pages, sink_pages, local_pages, budgets, width)
    _check_select(scores, num_pages, sink_pages, local_pages, budgets, width)
    if scores.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton radix Select needs CUDA tensors (or TRITON_INTERPRET=1); use select_ragged_ref")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk}: must be a power of two >= 16")
    B, hkv, P = scores.shape
    dev = scores.device
    want = torch.empty(B, hkv, width, dtype=torch.int64, device=dev)
    count = torch.empty(B, hkv, dtype=torch.int64, device=dev)  # pass 3 writes every row's
    if B == 0 or P == 0:
        return want.fill_(-1), count.zero_()
    scores, num_pages, budgets = scores.float().contiguous(), num_pages.contiguous(), budgets.contiguous()
    rows, chunks = B * hkv, -(-P // chunk)
    hist = torch.zeros(rows, 4098, dtype=torch.int32, device=dev)  # first-digit bins, candidates, pass-2 arrivals
    ckey = torch.empty(rows, P, dtype=torch.int64, device=dev)
    cidx = torch.empty(rows, P, dtype=torch.int32, device=dev)
    per_chunk = torch.empty(3, rows, chunks, dtype=torch.int32, device=dev)  # above bin d, ties before, kept before
    lo = torch.empty(rows, dtype=torch.int64, device=dev)
    take = torch.empty(rows, dtype=torch.int32, device=dev)
    k = load_kernel_module("_radix_select_kernel", "the Triton radix Select", "select_ragged_ref")
    common = dict(HKV=hkv, CH=chunk)
    k._radix_hist[(rows, chunks)](scores, num_pages, hist, P, sink_pages, local_pages, **common)
    pads = dict(T_PAD=max(16, next_pow2(chunks)), TILE=_TILE, W_PAD=next_pow2(width))
    if fused:
        k._radix_gather_last[(rows, chunks)](scores, num_pages, budgets, hist, ckey, cidx, per_chunk[0], lo, take,
                                             per_chunk[1], per_chunk[2], want, count, P, chunks, width, sink_pages,
                                             local_pages, **pads, **common)
        return want, count
    k._radix_gather[(rows, chunks)](scores, num_pages, budgets, hist, ckey, cidx, per_chunk[0], P, chunks,
                                    sink_pages, local_pages, **common)
    k._radix_resolve[(rows,)](num_pages, budgets, hist, ckey, cidx, per_chunk[0], lo, take, per_chunk[1],
                              per_chunk[2], want, count, P, chunks, width, sink_pages, local_pages, **pads, **common)
    k._radix_write[(rows, chunks)](scores, num_pages, lo, take, per_chunk[1], per_chunk[2], want, P, chunks, width,
                                   sink_pages, local_pages, **common)
    return want, count
