"""Quest's whole Select for one layer of a decode step: page scores, hysteresis and the
ragged per-head top-k in two launches (``page_scores``, the margin's adds and
``select_ragged`` before: four or five).

Contract (what ``quest_select`` returns; ``quest_select_ref`` spells it in torch)::

    q          : [B, H, D]       the step's queries, H = Hkv * G
    kmin/kmax  : [N, Hkv, D]     Quest's bounds of one layer (one block per page)
    pages      : [B, P]          int, index row of each of a request's P pages
    num_pages  : [B]             int, pages in each request's context (tail included), <= P
    budgets    : [B, Hkv]        int, middle pages each head may take
    held       : [B, Hkv, P]     bool or None, pages the GPU holds now
    margin     : float           score units added to every held page (0: none)
    dense_rows : [B]             bool or None, requests that take every middle page
    returns    : want [B, Hkv, W] int64, num_selected [B, Hkv] int64

    score[b, h, p] = page_scores(q, kmin, kmax, pages)[b, h, p]  (+ margin if held[b, h, p];
                     with margin != 0 every page is added margin or 0.0, as torch adds)
    page:   0 .. sink-1 | sink .. n-local-1          | n-local .. n-1      (n = num_pages[b])
            always kept | top budgets[b, h] pages     | always kept
                        | by score, -inf never taken,  |
                        | ties to the lower page id    |
    want[b, h]        = the kept pages in ascending page order, -1 padded to W (cut at W)
    num_selected[b, h] = number of kept pages (not cut at W)

This is ``select_layer``'s result on CUDA (``page_scores``, the margin, ``select_ragged``)
page for page: the same score sums (the kernels share their Triton helpers and block shape),
the same radix-select threshold and lowest-index tie rule, the same order. A dense row takes
every middle page whose score is above -inf: what the budget floor's budgets (which cover
the row's pages) give on the old path. Left to the old path by its caller: top-p, scoring
blocks smaller than a page, rows of more than ``MAX_ROW_PAGES`` pages.

Two passes, so that a request's row is spread over several programs (batch 1 is not one
program per KV head)::

    pass 1  grid (B * Hkv, chunks): a chunk of CHUNK pages scored and its own top
            min(budget, KC) middle pages kept as candidates, in page order
    pass 2  grid (B * Hkv,): ``_select_merge``, the row's top budget among its candidates
            (a page beaten by fewer than budget pages of the row is beaten by fewer than
            budget of its chunk), then sink + selected + local pages

No host sync; every shape comes from the arguments' shapes and ints (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module, next_pow2
from .page_select import MAX_ROW_PAGES, _check_scores, _row_launch, page_scores_ref, select_ragged_ref

__all__ = ["fused_pays", "quest_select", "quest_select_ref", "select_chunk"]

# Pages per scoring block of pass 1: ``page_scores``' block, so the float sums are its own.
SCORE_BLOCK = 64


def _check(q, kmin, kmax, pages, num_pages, budgets, held, dense_rows, sink_pages, local_pages, width):
    _check_scores(q, kmin, kmax, pages)
    B, P, hkv = q.shape[0], pages.shape[1], kmin.shape[1]
    if num_pages.shape != (B,) or budgets.shape != (B, hkv):
        raise ValueError(f"num_pages must be [B={B}] and budgets [B, Hkv={hkv}]; got {tuple(num_pages.shape)}, "
                         f"{tuple(budgets.shape)}")
    if held is not None and (held.shape != (B, hkv, P) or held.dtype != torch.bool):
        raise ValueError(f"held must be [B, Hkv, P]=({B}, {hkv}, {P}) bool, got {tuple(held.shape)} {held.dtype}")
    if dense_rows is not None and (dense_rows.shape != (B,) or dense_rows.dtype != torch.bool):
        raise ValueError(f"dense_rows must be [B={B}] bool, got {tuple(dense_rows.shape)} {dense_rows.dtype}")
    if min(sink_pages, local_pages) < 0 or width < 1:
        raise ValueError(f"need sink_pages, local_pages >= 0 and width >= 1; got {sink_pages}, {local_pages}, {width}")


def quest_select_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                     num_pages: torch.Tensor, sink_pages: int, local_pages: int, budgets: torch.Tensor, width: int,
                     held: torch.Tensor | None = None, margin: float = 0.0,
                     dense_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, kmin, kmax, pages, num_pages, budgets, held, dense_rows, sink_pages, local_pages, width)
    scores = page_scores_ref(q, kmin, kmax, pages)  # [B, Hkv, P]
    if held is not None and margin:
        scores = scores + (held * margin).to(scores.dtype)
    if dense_rows is not None:  # every middle page: a budget no row reaches
        budgets = torch.where(dense_rows[:, None], scores.shape[-1], budgets)
    return select_ragged_ref(scores, num_pages, sink_pages, local_pages, budgets, width)


# Where the two launches beat the separate steps (``bench_select.py --quest`` on the H200,
# 2026-12-05, per decode step of 32 layers, CUDA graphs): only with many rows and narrow
# selections (60 x 32K, uniform 2K budgets: 4.2 against 5.0 ms). With S-HPLB's per-head
# budgets (the widest head takes ~540 pages) a pass-1 program scores a chunk of 2048 pages in
# sequence and the grid has B * Hkv * 3 programs: 4.5 against 2.6 ms at 4 x 128K, 7.4 against
# 5.0 at 60 x 32K; at 1 x 128K 1.4 against 0.9 even with uniform budgets.
FUSED_MIN_ROWS = 128  # (request, KV head) rows
FUSED_MAX_WIDTH = 128  # pages a head selects, sink and local included


def fused_pays(rows: int, width: int) -> bool:
    """Whether ``quest_select`` is faster than the separate steps for ``rows`` (request, KV
    head) rows selecting up to ``width`` pages each (the measurements above)."""
    return rows >= FUSED_MIN_ROWS and width <= FUSED_MAX_WIDTH


def select_chunk(P: int, width: int) -> int:
    """Pages per pass-1 program: about four times a head's widest selection (so a chunk's
    candidates are a quarter of it or less), 256 to 2048 pages, no more than the row needs.
    At 128K tokens of 32-token pages and a 2K budget (width 74): chunks of 512, ten per row."""
    chunk = min(2048, max(256, next_pow2(4 * width)))
    return max(SCORE_BLOCK, min(chunk, next_pow2(P)))


def quest_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                 num_pages: torch.Tensor, sink_pages: int, local_pages: int, budgets: torch.Tensor, width: int,
                 held: torch.Tensor | None = None, margin: float = 0.0, dense_rows: torch.Tensor | None = None,
                 chunk: int | None = None, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: the two passes above. ``chunk``: pages per pass-1 program (a power of two
    >= 16; None: ``select_chunk``). "auto" takes the reference off CUDA and for rows of more
    than ``MAX_ROW_PAGES`` pages."""
    P = pages.shape[-1] if pages.dim() == 2 else 0
    if impl == "auto" and P > MAX_ROW_PAGES:
        impl = "torch"
    if resolve_impl(impl, q.device) == "torch":
        return quest_select_ref(q, kmin, kmax, pages, num_pages, sink_pages, local_pages, budgets, width, held,
                                margin, dense_rows)
    _check(q, kmin, kmax, pages, num_pages, budgets, held, dense_rows, sink_pages, local_pages, width)
    if q.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton Quest Select kernel needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "use quest_select_ref")
    if P > MAX_ROW_PAGES:
        raise ValueError(f"quest_select handles up to {MAX_ROW_PAGES} pages per row, got {P}")
    if q.stride(-1) != 1 or kmin.stride(-1) != 1 or kmax.stride(-1) != 1 or pages.stride(-1) != 1:
        raise ValueError("q, kmin, kmax and pages must be contiguous in their last dimension")
    B, H, D = q.shape
    hkv = kmin.shape[1]
    want = torch.empty(B, hkv, width, dtype=torch.int64, device=q.device)
    count = torch.empty(B, hkv, dtype=torch.int64, device=q.device)  # every merge program writes its row's
    if B == 0 or P == 0:
        return want.fill_(-1), count.zero_()
    chunk = select_chunk(P, width) if chunk is None else chunk
    if chunk & (chunk - 1) or chunk < 16:
        raise ValueError(f"chunk={chunk}: must be a power of two >= 16")
    chunks = -(-P // chunk)
    kc = min(chunk, width)  # a chunk's candidates: at most the widest selection
    x = torch.empty(B * hkv, chunks * chunk, dtype=torch.float32, device=q.device)  # scores, read back by pass 1
    cand_s = torch.empty(B * hkv, chunks, kc, dtype=torch.float32, device=q.device)
    cand_i = torch.empty(B * hkv, chunks, kc, dtype=torch.int32, device=q.device)
    num_pages, budgets = num_pages.contiguous(), budgets.contiguous()
    has_held = held is not None and bool(margin)
    held_u8 = held.view(torch.uint8) if has_held else budgets  # any pointer when unused
    dense_u8 = dense_rows.contiguous().view(torch.uint8) if dense_rows is not None else budgets
    if held_u8.stride(-1) != 1:
        held_u8 = held_u8.contiguous()
    k = load_kernel_module("_quest_select_kernel", "the Triton Quest Select kernel", "quest_select_ref")
    k._quest_select_local[(B * hkv, chunks)](
        q, kmin, kmax, pages, num_pages, budgets, dense_u8, held_u8, x, cand_s, cand_i,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1), pages.stride(0),
        held_u8.stride(0) if has_held else 0, held_u8.stride(1) if has_held else 0, float(margin),
        P, sink_pages, local_pages, kc,
        HKV=hkv, G=H // hkv, G_PAD=next_pow2(H // hkv), D=D, D_PAD=1 << max(4, (D - 1).bit_length()),
        BLOCK_P=min(SCORE_BLOCK, chunk), CHUNK=chunk, KC_PAD=next_pow2(kc), HAS_HELD=has_held,
        HAS_DENSE=dense_rows is not None, num_warps=4,
    )
    c = chunks * kc
    c_pad, warps = _row_launch(c)
    merge = load_kernel_module("_page_select_kernel", "the Triton Select kernels", "their *_ref functions")._select_merge
    merge[(B * hkv,)](
        cand_s, cand_i, num_pages, budgets, dense_u8, want, count, c, width, sink_pages, local_pages,
        HKV=hkv, C_PAD=c_pad, W_PAD=next_pow2(width), HAS_DENSE=dense_rows is not None, num_warps=warps,
    )
    return want, count
