"""Select kernels: Quest page scoring and per-head top-k with ragged budgets.

Page scoring (Quest bounds), per request b, KV head h and page p::

    q        : [B, H, D]        H = Hkv * G
    kmin/kmax: [N, Hkv, D]      per-page key bounds, N index rows
    pages    : [B, P]           int, index row of each of the request's P pages
    scores   : [B, Hkv, P]      float32
    score[b, h, p] = sum_g sum_d max(q[b, hG+g, d] * kmin[pages[b,p], h, d],
                                     q[b, hG+g, d] * kmax[pages[b,p], h, d])
                   = qsum . (kmin + kmax) / 2 + qabs . (kmax - kmin) / 2

with qsum = sum_g q, qabs = sum_g |q|. Pages never written hold kmin = +inf, kmax = -inf:
their score is 0 here (the caller masks pages past a request's length anyway).

Ragged top-k::

    scores  : [B, Hkv, P]  float32
    budgets : [B, Hkv]     int, pages to take per head (0 .. k)
    returns : [B, Hkv, k]  int64 indices of the top min(budgets[b, h], k) scores (ties:
                           lower index first; -inf scores never taken), in ascending index
                           order, -1 padded at the end.

Fused Select (what the engine runs on the GPU: one launch per layer instead of a dozen)::

    scores    : [B, Hkv, P]  float32, the algorithm's page scores
    num_pages : [B]          int, pages in each request's context (tail included)
    budgets   : [B, Hkv]     int, middle pages each head may take
    returns   : want [B, Hkv, W] int64 page ids kept, ascending, -1 padded: the first
                ``sink_pages``, the last ``local_pages`` and the top ``budgets[b, h]`` middle
                pages by score (as ``topk_ragged``); num_selected [B, Hkv] int64

Each has a Triton kernel and a torch reference of the same signature (``*_ref``); the
public launcher takes ``impl="auto"`` (``kernels._impl``: the kernel on CUDA, the reference
elsewhere; "triton" or "torch" to choose). Rows longer than ``MAX_ROW_PAGES`` do not fit the
top-k kernels: "auto" takes the reference for them. None syncs with the host. This module imports only torch (and Triton, lazily).
"""

from __future__ import annotations


import torch

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module, next_pow2
from .fp8_pages import FP8_MAX

__all__ = ["label_append", "label_append_ref", "label_query", "label_query_ref", "label_scores", "label_scores_ref", "page_scores", "page_scores_ref", "row_tiles", "select_ragged",
           "select_ragged_ref", "topk_ragged", "topk_ragged_ref"]

# One program holds a whole row of page scores in registers.
MAX_ROW_PAGES = 16384


def _check_scores(q, kmin, kmax, pages):
    if q.dim() != 3 or kmin.dim() != 3 or kmax.shape != kmin.shape:
        raise ValueError(f"q must be [B, H, D], kmin/kmax [N, Hkv, D]; got {tuple(q.shape)}, {tuple(kmin.shape)}")
    B, H, D = q.shape
    if kmin.shape[2] != D or H % kmin.shape[1]:
        raise ValueError(f"head dims or head counts disagree: q {tuple(q.shape)}, kmin {tuple(kmin.shape)}")
    if pages.dim() != 2 or pages.shape[0] != B or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pages must be [B={B}, P] int32/int64, got {tuple(pages.shape)} {pages.dtype}")


def page_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    _check_scores(q, kmin, kmax, pages)
    B, H, D = q.shape
    hkv = kmin.shape[1]
    lo, hi = kmin[pages.long()].float(), kmax[pages.long()].float()  # [B, P, Hkv, D]
    center = ((lo + hi) / 2).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    radius = ((hi - lo) / 2).nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(min=0)
    qg = q.float().view(B, hkv, H // hkv, D)
    qsum, qabs = qg.sum(2), qg.abs().sum(2)  # [B, Hkv, D]
    return torch.einsum("bhd,bphd->bhp", qsum, center) + torch.einsum("bhd,bphd->bhp", qabs, radius)


def _check_topk(scores, budgets, k):
    if scores.dim() != 3 or budgets.shape != scores.shape[:2]:
        raise ValueError(f"scores must be [B, Hkv, P] and budgets [B, Hkv]; got {tuple(scores.shape)}, {tuple(budgets.shape)}")
    if not 1 <= k:
        raise ValueError(f"k must be >= 1, got {k}")


def topk_ragged_ref(scores: torch.Tensor, budgets: torch.Tensor, k: int) -> torch.Tensor:
    _check_topk(scores, budgets, k)
    P = scores.shape[-1]
    kk = min(k, P)
    # Stable order: descending score, then ascending index.
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    idx, val = order.indices[..., :kk], order.values[..., :kk]
    rank = torch.arange(kk, device=scores.device)
    ok = (rank < budgets[..., None]) & (val > float("-inf"))
    # Ascending index order, -1 last.
    out = torch.sort(torch.where(ok, idx, P), dim=-1).values
    out = torch.where(out == P, -1, out)
    if kk < k:
        out = torch.nn.functional.pad(out, (0, k - kk), value=-1)
    return out


def _kernels():
    return load_kernel_module("_page_select_kernel", "the Triton Select kernels", "their *_ref functions")


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor, *,
                impl: str = "auto") -> torch.Tensor:
    if resolve_impl(impl, q.device) == "torch":
        return page_scores_ref(q, kmin, kmax, pages)
    _check_scores(q, kmin, kmax, pages)
    if q.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton page-score kernel needs CUDA tensors (or TRITON_INTERPRET=1); use page_scores_ref")
    B, H, D = q.shape
    hkv, P = kmin.shape[1], pages.shape[1]
    out = torch.empty(B, hkv, P, dtype=torch.float32, device=q.device)
    if B == 0 or P == 0:
        return out
    block_p = 64
    d_pad = 1 << max(4, (D - 1).bit_length())
    g_pad = 1 << max(0, (H // hkv - 1).bit_length())
    _kernels()._page_scores[(B * hkv, -(-P // block_p))](
        q, kmin, kmax, pages, out,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1),
        pages.stride(0), P,
        HKV=hkv, G=H // hkv, G_PAD=g_pad, D=D, D_PAD=d_pad, BLOCK_P=block_p,
    )
    return out


def topk_ragged(scores: torch.Tensor, budgets: torch.Tensor, k: int, *, impl: str = "auto") -> torch.Tensor:
    """Triton: per row, a threshold by radix select over the scores' order-preserving integer
    keys (four 256-bin histogram passes over the row held in registers, no sort), then the
    pages above it (and the lowest-index ties) compacted by a prefix sum. One program per
    row, up to 16K pages (256K tokens at S=16): "auto" takes the reference for longer rows."""
    if _select_impl(impl, scores) == "torch":
        return topk_ragged_ref(scores, budgets, k)
    _check_topk(scores, budgets, k)
    if scores.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton top-k kernel needs CUDA tensors (or TRITON_INTERPRET=1); use topk_ragged_ref")
    B, hkv, P = scores.shape
    if P > MAX_ROW_PAGES:
        raise ValueError(f"topk_ragged handles up to {MAX_ROW_PAGES} pages per row, got {P}")
    out = torch.full((B, hkv, k), -1, dtype=torch.int64, device=scores.device)
    if B == 0 or P == 0:
        return out
    p_pad, num_warps = _row_launch(P)
    _kernels()._topk_ragged[(B * hkv,)](scores.float().contiguous(), budgets.to(torch.int32).contiguous(), out,
                                        P, k, P_PAD=p_pad, num_warps=num_warps)
    return out


def _select_impl(impl: str, scores: torch.Tensor) -> str:
    """``resolve_impl`` for the top-k kernels, which hold a row of at most MAX_ROW_PAGES."""
    fits = scores.dim() == 3 and scores.shape[-1] <= MAX_ROW_PAGES
    return "torch" if impl == "auto" and not fits else resolve_impl(impl, scores.device)


def _row_launch(P: int) -> tuple[int, int]:
    """(P_PAD, num_warps) of a one-row-per-program kernel: 8 keys or more per thread, at most
    16 warps. A decode step has few rows (B x Hkv: 32 at batch 4), so a row's latency is the
    launch's: on the H200 (``benchmarks/bench_select.py``, 4096 pages) the radix select took
    70 us with 4 warps, 38 us with 8, 24 us with 16 and 30 us with 32."""
    p_pad = 1 << max(4, (P - 1).bit_length())
    return p_pad, min(16, max(4, p_pad // 256))


def row_tiles(P: int) -> tuple[int, int, int]:
    """(P_PAD, TAIL, num_warps) of ``_select_ragged``: a row just past a power of two (a
    decode step's width rounded up: 5120 pages at 128K) is a tile of the power of two below
    it and a tail tile, not one tile twice the row; TAIL 0: one tile. On an H100 the
    one-tile radix select took 24 us a layer at 4096 pages and 40 at 5120 (padded to 8192)."""
    p_pad, warps = _row_launch(P)
    half = p_pad // 2
    if P <= 16 or P == p_pad:
        return p_pad, 0, warps
    tail = 1 << max(4, (P - half - 1).bit_length())
    if tail >= half:
        return p_pad, 0, warps
    return half, tail, _row_launch(half + tail)[1]


def _check_select(scores, num_pages, sink_pages, local_pages, budgets, width):
    _check_topk(scores, budgets, 1)
    if num_pages.shape != scores.shape[:1]:
        raise ValueError(f"num_pages must be [B={scores.shape[0]}], got {tuple(num_pages.shape)}")
    if min(sink_pages, local_pages) < 0 or width < 1:
        raise ValueError(f"need sink_pages, local_pages >= 0 and width >= 1; got {sink_pages}, {local_pages}, {width}")


def select_ragged_ref(scores: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, local_pages: int,
                      budgets: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_select(scores, num_pages, sink_pages, local_pages, budgets, width)
    B, hkv, P = scores.shape
    p = torch.arange(P, device=scores.device)
    n = num_pages[:, None, None]
    in_ctx = p < n
    edge = in_ctx & ((p < sink_pages) | (p >= n - local_pages))  # [B, 1, P]
    masked = torch.where(in_ctx & ~edge, scores.float(), float("-inf"))
    idx = topk_ragged_ref(masked, budgets, max(1, min(width, P)))  # ascending, -1 padded
    mid = torch.zeros(B, hkv, P + 1, dtype=torch.bool, device=scores.device)
    mid.scatter_(-1, torch.where(idx >= 0, idx, P), True)
    keep = edge | mid[..., :P]
    pos = keep.cumsum(-1) - 1
    want = torch.full((B, hkv, width + 1), -1, dtype=torch.int64, device=scores.device)
    want.scatter_(-1, torch.where(keep & (pos < width), pos, width), p.expand(B, hkv, P))
    return want[..., :width], keep.sum(-1)


def select_ragged(scores: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, local_pages: int,
                  budgets: torch.Tensor, width: int, num_warps: int = 0,
                  chunk: int | None = None, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: the edge masks, the radix-select top-k over the middle pages, and the
    compaction of ``select_ragged_ref``.

    One program per (request, KV head) row when rows are short or budgets wide. Otherwise the
    row is split (``chunk`` pages per program, ``split_chunk``): each chunk keeps its own top
    budget as candidates, and one program per row selects among those. At a decode step's
    few rows a whole row per program is latency-bound: at 128K tokens a row is 4096+ pages
    padded to a power of two, on 32 of the GPU's 132 SMs. ``num_warps``: of a whole-row
    program (0: ``_row_launch``). ``chunk=0`` forces the whole-row kernel. Rows longer than
    ``MAX_ROW_PAGES``: "auto" takes the reference."""
    if _select_impl(impl, scores) == "torch":
        return select_ragged_ref(scores, num_pages, sink_pages, local_pages, budgets, width)
    _check_select(scores, num_pages, sink_pages, local_pages, budgets, width)
    if scores.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton Select kernel needs CUDA tensors (or TRITON_INTERPRET=1); use select_ragged_ref")
    B, hkv, P = scores.shape
    if P > MAX_ROW_PAGES:
        raise ValueError(f"select_ragged handles up to {MAX_ROW_PAGES} pages per row, got {P}")
    want = torch.empty(B, hkv, width, dtype=torch.int64, device=scores.device)
    count = torch.empty(B, hkv, dtype=torch.int64, device=scores.device)  # every program writes its row's
    if B == 0 or P == 0:
        return want.fill_(-1), count.zero_()
    scores, num_pages, budgets = scores.float().contiguous(), num_pages.contiguous(), budgets.contiguous()
    w_pad = 1 << max(0, (width - 1).bit_length())
    if chunk is None:
        chunk = split_chunk(P, width)
    if chunk:
        if chunk & (chunk - 1) or chunk < 16:
            raise ValueError(f"chunk={chunk}: must be a power of two >= 16")
        chunks = -(-P // chunk)
        kc = min(chunk, width)  # a chunk's candidates: at most the widest budget
        cand_s = torch.empty(B * hkv, chunks, kc, dtype=torch.float32, device=scores.device)
        cand_i = torch.empty(B * hkv, chunks, kc, dtype=torch.int32, device=scores.device)
        k = _kernels()
        k._select_local[(B * hkv, chunks)](
            scores, num_pages, budgets, cand_s, cand_i, P, sink_pages, local_pages, kc,
            HKV=hkv, CHUNK=chunk, KC_PAD=1 << max(0, (kc - 1).bit_length()), num_warps=min(8, max(1, chunk // 128)),
        )
        c = chunks * kc
        c_pad, warps = _row_launch(c)
        k._select_merge[(B * hkv,)](
            cand_s, cand_i, num_pages, budgets, budgets, want, count, c, width, sink_pages, local_pages,
            HKV=hkv, C_PAD=c_pad, W_PAD=w_pad, HAS_DENSE=False, num_warps=warps,
        )
        return want, count
    p_pad, tail, warps = row_tiles(P)
    num_warps = num_warps or warps
    _kernels()._select_ragged[(B * hkv,)](
        scores, num_pages, budgets, want, count,
        P, width, sink_pages, local_pages,
        HKV=hkv, P_PAD=p_pad, W_PAD=w_pad, TAIL=tail, num_warps=num_warps,
    )
    return want, count


SPLIT_CHUNK = 1024


def split_chunk(P: int, width: int) -> int:
    """Pages per program of the split-row Select, or 0 for one program per row: the split
    pays when the row spans several chunks and the candidates (a chunk keeps at most
    ``width``) are at most a quarter of the padded row."""
    chunks = -(-P // SPLIT_CHUNK)
    p_pad = 1 << max(4, (P - 1).bit_length())
    if chunks < 2 or 4 * chunks * min(SPLIT_CHUNK, width) > p_pad:
        return 0
    return SPLIT_CHUNK


# ---- label-cache scores ------------------------------------------------------------------------

def _check_labels(qr, labels, rows, lengths, span, num_pages, page_size, held=None):
    B, hkv, rc = qr.shape
    if held is not None and (held.shape != (B, hkv, num_pages) or held.dtype != torch.bool):
        raise ValueError(f"held must be a bool [{B}, {hkv}, {num_pages}]; got {held.dtype} {tuple(held.shape)}")
    if labels.dim() != 3 or labels.shape[1:] != (hkv, rc):
        raise ValueError(f"labels must be [N, {hkv}, {rc}] like qr [B, Hkv, r]; got {tuple(labels.shape)}")
    if rows.shape != (B,) or lengths.dim() != 1:
        raise ValueError("rows must be [B] and lengths [R]")
    if num_pages * page_size > span:
        raise ValueError(f"{num_pages} pages of {page_size} tokens exceed a row's {span} tokens")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: the label scorer needs a power of 2")


def label_scores_ref(qr, labels, rows, lengths, span: int, num_pages: int, page_size: int,
                     held: torch.Tensor | None = None, margin: float = 0.0) -> torch.Tensor:
    """[B, Hkv, num_pages]: per page, the largest ``qr . labels[t]`` over its written tokens
    (-inf for a page with none), plus ``margin`` where ``held`` [B, Hkv, num_pages] (bool:
    the pages the GPU buffer holds, Select's hysteresis) is set.

    qr [B, Hkv, r] (a query summed over its KV head's query heads, in the label channels);
    labels [N, Hkv, r] (row-major, ``span`` tokens per request row); rows [B]; lengths [R]
    tokens written per row."""
    _check_labels(qr, labels, rows, lengths, span, num_pages, page_size, held)
    n = num_pages * page_size
    # (A row's unwritten tokens are masked below; the padding row's, past the requests' rows,
    # would reach past the labels' last entry, its one token.)
    at = (rows[:, None] * span + torch.arange(n, device=qr.device)).clamp_(max=labels.shape[0] - 1)  # [B, n]
    s = torch.einsum("bhr,bnhr->bhn", qr.float(), labels[at].float())  # [B, Hkv, n]
    written = torch.arange(n, device=qr.device) < lengths[rows][:, None]  # [B, n]
    s = s.masked_fill(~written[:, None, :], float("-inf"))
    s = s.view(*s.shape[:2], num_pages, page_size).amax(-1)
    return s if held is None else s + (held * margin).to(s.dtype)


def _check_query(q, channel_ids):
    if q.dim() != 3 or channel_ids.dim() != 2 or q.shape[1] % channel_ids.shape[0]:
        raise ValueError(f"q must be [B, H, D] and channel_ids [Hkv, r] with Hkv dividing H; got "
                         f"{tuple(q.shape)}, {tuple(channel_ids.shape)}")


def label_query_ref(q: torch.Tensor, channel_ids: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, r] float32, what ``label_scores`` scores the labels against: q [B, H, D]
    summed in float32 over each KV head's G = H / Hkv query heads, in the head's label
    channels channel_ids [Hkv, r]."""
    _check_query(q, channel_ids)
    B, H, D = q.shape
    hkv = channel_ids.shape[0]
    qs = q.view(B, hkv, H // hkv, D).sum(2, dtype=torch.float32)  # [B, Hkv, D]
    return qs.gather(2, channel_ids[None].expand(B, -1, -1))


def label_query(q: torch.Tensor, channel_ids: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Triton ``label_query_ref``: one launch (a program per request, only the r channels
    read) for the reference's two and its [B, Hkv, D] sum. A launch of its own: in each
    scoring program it took the scorer from 48.3 to 116.8 us a layer at 4 x 128K on an H100
    (``docs/log/performance-2026.md``)."""
    if resolve_impl(impl, q.device) == "torch":
        return label_query_ref(q, channel_ids)
    _check_query(q, channel_ids)
    if q.stride(2) != 1 or not channel_ids.is_contiguous():
        raise ValueError("q must be contiguous in its last dimension and channel_ids contiguous")
    B, H, _ = q.shape
    hkv, rc = channel_ids.shape
    out = torch.empty(B, hkv, rc, dtype=torch.float32, device=q.device)
    if B:
        _kernels()._label_query[(B,)](q, channel_ids, out, q.stride(0), q.stride(1), HKV=hkv,
                                      HKV_PAD=next_pow2(hkv), G=H // hkv, RC=rc, RC_PAD=next_pow2(rc))
    return out


# Label values a scoring program reads: at Llama-3.1-8B's shapes (8 KV heads of r = 32) one
# page of 32 tokens for all heads, 8 KiB in e4m3.
LABEL_TILE_VALUES = 8192


def label_block_pages(page_size: int, hkv: int, rc: int, tile_values: int = LABEL_TILE_VALUES) -> int:
    """Pages one scoring program takes: a power of two, about ``tile_values`` label values
    (every KV head's r of each token), at least one page."""
    per_page = page_size * next_pow2(hkv) * max(4, next_pow2(rc))
    return 1 << max(0, (tile_values // per_page).bit_length() - 1)


def label_scores(qr, labels, rows, lengths, span: int, num_pages: int, page_size: int,
                 held: torch.Tensor | None = None, margin: float = 0.0, *,
                 impl: str = "auto", tile_values: int = LABEL_TILE_VALUES, num_warps: int = 4) -> torch.Tensor:
    """Triton ``label_scores_ref``: one program per request and block of pages
    (``label_block_pages``), every KV head's labels of the block read as one contiguous tile;
    the hysteresis added in the same launch."""
    if resolve_impl(impl, qr.device) == "torch":
        return label_scores_ref(qr, labels, rows, lengths, span, num_pages, page_size, held, margin)
    _check_labels(qr, labels, rows, lengths, span, num_pages, page_size, held)
    if qr.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton label scorer needs CUDA tensors (or TRITON_INTERPRET=1); use label_scores_ref")
    if labels.stride(2) != 1 or labels.stride(1) != labels.shape[2] or qr.stride(2) != 1:
        raise ValueError("labels must be contiguous in their last two dimensions, qr in its last")
    B, hkv, rc = qr.shape
    out = torch.empty(B, hkv, num_pages, dtype=torch.float32, device=qr.device)
    if B == 0 or num_pages == 0:
        return out
    block_p = label_block_pages(page_size, hkv, rc, tile_values)
    _kernels()._label_scores[(B, -(-num_pages // block_p))](
        qr, labels, rows, lengths, out if held is None else held.contiguous(), out, qr.stride(0), qr.stride(1),
        labels.stride(0), labels.stride(1), span, num_pages, float(margin), HKV=hkv,
        HKV_PAD=next_pow2(hkv), RC=rc, RC_PAD=max(4, next_pow2(rc)), S=page_size,
        BLOCK_P=block_p, HAS_HELD=held is not None, num_warps=num_warps,
    )
    return out


def label_append_ref(labels: torch.Tensor, k: torch.Tensor, channel_ids: torch.Tensor, slots: torch.Tensor) -> None:
    """labels [N, Hkv, r] (float, or float8_e4m3fn: clamped to +-448, rounded to nearest)
    at rows slots [T] := k [T, Hkv, D] in the channels channel_ids [Hkv, r] of each head."""
    _check_append(labels, k, channel_ids, slots)
    lab = k.gather(2, channel_ids[None].expand(k.shape[0], -1, -1))
    if labels.dtype == torch.float8_e4m3fn:  # e4m3 has no inf: past +-448 a cast gives NaN
        lab = lab.clamp(-FP8_MAX, FP8_MAX).to(labels.dtype).view(torch.uint8)
        labels.view(torch.uint8).index_copy_(0, slots, lab)  # index_copy_ takes no fp8 (CPU)
        return
    labels.index_copy_(0, slots, lab.to(labels.dtype))


def label_append(labels: torch.Tensor, k: torch.Tensor, channel_ids: torch.Tensor, slots: torch.Tensor, *,
                 impl: str = "auto") -> None:
    """Triton ``label_append_ref``: one launch (a program per token) where the reference
    takes four (gather, clamp, cast, copy) each layer of each step."""
    if resolve_impl(impl, k.device) == "torch":
        return label_append_ref(labels, k, channel_ids, slots)
    _check_append(labels, k, channel_ids, slots)
    if k.shape[0] == 0:
        return
    hkv, rc = channel_ids.shape
    fp8 = labels.dtype == torch.float8_e4m3fn
    _kernels()._label_append[(k.shape[0],)](
        k, channel_ids, slots, labels.view(torch.uint8) if fp8 else labels, k.stride(0), k.stride(1),
        labels.stride(0), labels.stride(1), HKV=hkv, HKV_PAD=next_pow2(hkv), RC=rc, RC_PAD=next_pow2(rc), FP8=fp8,
    )


def _check_append(labels, k, channel_ids, slots):
    if k.dim() != 3 or channel_ids.shape != (k.shape[1], labels.shape[2]) or labels.shape[1] != k.shape[1]:
        raise ValueError(f"k must be [T, Hkv, D], channel_ids [Hkv, r] and labels [N, Hkv, r]; got "
                         f"{tuple(k.shape)}, {tuple(channel_ids.shape)}, {tuple(labels.shape)}")
    if slots.shape != (k.shape[0],) or k.stride(2) != 1 or not channel_ids.is_contiguous():
        raise ValueError("slots must be [T], k contiguous in its last dimension and channel_ids contiguous")
