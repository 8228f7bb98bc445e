"""Quest's Select in two levels: groups of pages first, then pages inside the best groups.

Why: Quest's Select reads every page's key bounds (kmin and kmax, 2 x D values per page and
KV head) to score it, and then ranks the whole row. At 128K tokens and a budget of 2048
tokens a head that is twice the bytes the attention itself reads, and the ranking of a
4096-page row by one program is latency-bound (on the H200: ``_page_scores`` ~29 us and
``_select_ragged`` ~47 us a layer at 4 x 128K, ``benchmarks/results/profiles/``). Bounds over
a group of ``GP`` pages bound every page in it, so a group's score is at least any of its
pages' scores: score the P / GP groups, keep the ``ceil(budget * factor / GP)`` best, and
score and rank only the pages inside them. At GP = 16 and factor 4, a head with a budget of
64 pages reads 256 group bounds and 256 page bounds instead of 4096 page bounds, and ranks
256 pages. It is Quest's top-k exactly wherever the kept groups hold Quest's top pages (always
when the groups kept are all of them: ``factor`` large); elsewhere an approximation whose
loss the accuracy runs measure (``docs/accuracy.md``).

Coarse bounds are a function of the page bounds: coarse row c holds the min and max over page
rows c * GP .. c * GP + GP - 1 (``coarse_refresh``, after an append, for the rows its tokens
touched; in a decode step the Select itself first rebuilds each request's last group, the only
one a decode token changes, so the step needs no refresh launch). A page row never written holds (+inf, -inf) and drops out; a page row an earlier
request left behind only widens its group's bounds, which stay bounds. Page rows of a group
must be consecutive: the index hands out pages in segments that GP divides.

    q            [B, H, D]      the step's queries (H = Hkv * G)
    kmin, kmax   [N, Hkv, D]    page bounds of the layer (N = NC * GP + 1: the last a dump row)
    cmin, cmax   [NC + 1, Hkv, D] coarse bounds (the last a dump row)
    pages        [B, P]         page row of each of a request's P pages (``Quest._score_blocks``)
    num_pages    [B], budgets [B, Hkv], sink_pages, local_pages, width: as ``select_ragged``
    held         [B, Hkv, P] bool or None; margin: score units added to held pages (hysteresis;
                 a group with a held middle page gets it too)
    dense_rows   [B] bool or None: rows that take every middle page
    returns      want [B, Hkv, W] int64, num_selected [B, Hkv] int64 (``select_ragged``'s form);
                 each request's last group's rows of cmin and cmax rebuilt in place

Launches (``coarse_select(split=...)``): one program a row doing the four stages in turn
(score the groups, keep the best, score their pages, rank them), or, by default in Quest, two
launches of many programs a row, the first scoring groups and the second candidate pages, each
ranked by the row's last program to finish. At a decode step's few rows the one program a row
is the Select's latency: on an H100 at 128K and batch 1, 1.95 against 1.27 ms a 32-layer step
(``docs/performance.md``). A count, not a launch of its own, starts each ranking: two
launches a layer instead of four in a chain of small ones.

``coarse_select_ref`` is the same in torch ops (``page_scores_ref``, ``topk_ragged_ref`` and
``select_ragged_ref``); the Triton launches give its pages (tested equal under the interpreter
where the scores are exact). No host sync; shapes come from the arguments (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module, next_pow2
from .page_select import page_scores_ref, row_tiles, select_ragged_ref, topk_ragged_ref

__all__ = ["coarse_candidates", "group_rows", "coarse_refresh", "coarse_refresh_ref", "coarse_select", "coarse_select_ref"]

# Groups or pages per iteration of a row's loops, and warps per program (one per request and
# KV head). 128 and 16 against 64 and 8 on an H200 (Quest's Select of a 32-layer step, CUDA
# graph, 4 x 128K, S-HPLB budgets, groups of 16 pages): 1842 against 2286 us split, and at
# uniform budgets 1407 against 1426 (benchmarks/results/select/2026-12-06-h200-*).
_TILE = 128
_WARPS = 16
# The spread launches (``split``): groups scored a program in the first, candidate pages in
# the second, and their warps (the second's last program ranks up to 2048 + 128 candidates).
# 4 and 8 warps against 8 and 16 on an H100 (Quest's Select of a 32-layer step, CUDA graph,
# 4 x 128K, groups of 16): 879 against 950 us at uniform budgets, 1227 against 1336 at S-HPLB's
# (benchmarks/results/select/2026-12-06-h100-bench-select-spread-warps-09615ed.json).
_SPREAD_GROUPS = 64
_SPREAD_PAGES = 128
_SPREAD_WARPS = (4, 8)


def coarse_candidates(max_budget: int, num_pages: int, group_pages: int, factor: int) -> int:
    """Most candidate pages any row scores: its kept groups' pages."""
    groups = -(-num_pages // group_pages)
    return min(groups, -(-max_budget * factor // group_pages)) * group_pages


def group_rows(pages, group_pages: int):
    """[B, P / GP] the coarse row of each group of ``pages`` [B, P]: its first page's row // GP."""
    first = pages[:, ::group_pages]
    return torch.where(first >= 0, first // group_pages, 0).contiguous()


def coarse_refresh_ref(kmin, kmax, cmin, cmax, crow, group_pages: int) -> None:
    """Rebuild coarse rows ``crow`` [T] (the dump row NC allowed) from their page rows."""
    nc = cmin.shape[0] - 1
    rows = torch.unique(crow)
    rows = rows[rows < nc]
    if rows.numel() == 0:
        return
    at = rows[:, None] * group_pages + torch.arange(group_pages, device=crow.device)  # [U, GP]
    cmin[rows] = kmin[at].float().amin(1).to(cmin.dtype)
    cmax[rows] = kmax[at].float().amax(1).to(cmax.dtype)


def coarse_refresh(kmin, kmax, cmin, cmax, crow, group_pages: int, *, impl: str = "auto") -> None:
    """Triton on CUDA (one launch: one program per (token, KV head), the first token of each
    run of a coarse row rebuilding it), else ``coarse_refresh_ref``."""
    if resolve_impl(impl, crow.device) == "torch":
        return coarse_refresh_ref(kmin, kmax, cmin, cmax, crow, group_pages)
    T, (hkv, D) = crow.shape[0], kmin.shape[1:]
    if T == 0:
        return
    _check_layout(kmin, kmax, cmin, cmax)
    _kernels()._coarse_refresh[(T, hkv)](kmin, kmax, cmin, cmax, crow, T, cmin.shape[0] - 1, kmin.stride(0), kmin.stride(1),
                                         cmin.stride(0), cmin.stride(1), GP=group_pages, D=D, D_PAD=next_pow2(D))


def _check_layout(kmin, kmax, cmin, cmax):
    if kmin.stride() != kmax.stride() or cmin.stride() != cmax.stride() or kmin.stride(2) != 1 or cmin.stride(2) != 1:
        raise ValueError("kmin/kmax and cmin/cmax need one layout each, contiguous in the head dim")


def _check(q, kmin, cmin, pages, num_pages, budgets, group_pages, factor):
    if q.dim() != 3 or kmin.dim() != 3 or cmin.dim() != 3 or cmin.shape[1:] != kmin.shape[1:]:
        raise ValueError(f"q must be [B, H, D], kmin [N, Hkv, D] and cmin [NC + 1, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(kmin.shape)}, {tuple(cmin.shape)}")
    B = q.shape[0]
    if pages.dim() != 2 or pages.shape[0] != B or num_pages.shape != (B,) or budgets.shape != (B, kmin.shape[1]):
        raise ValueError(f"pages [B, P], num_pages [B] and budgets [B, Hkv] for B={B}; got {tuple(pages.shape)}, "
                         f"{tuple(num_pages.shape)}, {tuple(budgets.shape)}")
    if group_pages < 1 or group_pages & (group_pages - 1) or group_pages > 64 or factor < 1:
        raise ValueError(f"group_pages={group_pages} must be a power of two up to 64 and factor={factor} >= 1")


def _budgets(budgets, dense_rows, P):
    if dense_rows is None:
        return budgets
    return torch.where(dense_rows[:, None].bool(), torch.full_like(budgets, P), budgets)


def coarse_select_ref(q, kmin, kmax, cmin, cmax, pages, num_pages, sink_pages: int, local_pages: int, budgets,
                      width: int, group_pages: int, factor: int, held=None, margin: float = 0.0, dense_rows=None):
    _check(q, kmin, cmin, pages, num_pages, budgets, group_pages, factor)
    B, P, GP = q.shape[0], pages.shape[1], group_pages
    dev = q.device
    budgets = _budgets(budgets, dense_rows, P)
    PG = -(-P // GP)
    n = num_pages.long()[:, None, None]
    s_end = n.clamp(max=sink_pages)
    l_start = torch.maximum(n - local_pages, s_end)
    budget = torch.minimum(budgets.long(), (l_start - s_end)[..., 0]).clamp(min=0)  # [B, Hkv]
    _refresh_last_groups(kmin, kmax, cmin, cmax, pages, num_pages, GP)
    g = torch.arange(PG, device=dev)
    gscore = page_scores_ref(q, cmin, cmax, group_rows(pages, GP))  # [B, Hkv, PG]
    g_ok = (g * GP < l_start) & ((g + 1) * GP > s_end)  # [B, 1, PG]: a group with a middle page
    p = torch.arange(P, device=dev)
    middle = (p >= s_end) & (p < l_start)  # [B, 1, P]
    scores = page_scores_ref(q, kmin, kmax, pages)
    if held is not None and margin:
        h = held.bool() & middle
        padded = torch.zeros(*h.shape[:2], PG * GP, dtype=torch.bool, device=dev)
        padded[..., :P] = h
        gscore = gscore + margin * padded.view(*h.shape[:2], PG, GP).any(-1)
        scores = scores + margin * held.bool()
    gscore = torch.where(g_ok, gscore, float("-inf"))
    m = torch.minimum(-(-budget * factor // GP), (gscore > float("-inf")).sum(-1))
    kept = topk_ragged_ref(gscore, m, PG)  # [B, Hkv, PG] ascending group ids, -1 padded
    cand = torch.zeros(*kept.shape[:2], PG + 1, dtype=torch.bool, device=dev)
    cand.scatter_(-1, torch.where(kept >= 0, kept, PG), True)
    masked = torch.where(cand[..., p // GP], scores, float("-inf"))
    return select_ragged_ref(masked, num_pages, sink_pages, local_pages, budget, width)


def _refresh_last_groups(kmin, kmax, cmin, cmax, pages, num_pages, group_pages: int) -> None:
    """Each request's last group rebuilt from its pages' bounds (what a decode token changed)."""
    n = num_pages.long()
    last = pages.gather(1, ((n - 1).clamp(min=0) // group_pages * group_pages)[:, None])[:, 0]  # [B]
    crow = torch.where((n > 0) & (last >= 0), last // group_pages, cmin.shape[0] - 1)
    at = crow[:, None] * group_pages + torch.arange(group_pages, device=crow.device)  # [B, GP]
    at = at.clamp(max=kmin.shape[0] - 1)  # the dump row's pages: the page dump row
    # The dump row stays empty: its pages' bounds are the page dump row's (+inf, -inf).
    cmin[crow] = kmin[at].float().amin(1).to(cmin.dtype)
    cmax[crow] = kmax[at].float().amax(1).to(cmax.dtype)


def _kernels():
    return load_kernel_module("_coarse_select_kernel", "the Triton two-level Select", "coarse_select_ref")


def coarse_select(q, kmin, kmax, cmin, cmax, pages, num_pages, sink_pages: int, local_pages: int, budgets,
                  width: int, group_pages: int, factor: int, held=None, margin: float = 0.0, dense_rows=None,
                  *, max_budget: int | None = None, split: bool = False, tickets=None, impl: str = "auto"):
    """On CUDA the Triton Select, else ``coarse_select_ref``. ``split`` False: one launch, one
    program per request and KV head, whose four stages run one after another (at a few rows,
    the Select's latency). True: two launches, each of many programs a row (groups of
    ``_SPREAD_GROUPS``, then candidates of ``_SPREAD_PAGES``), the row's last program to finish
    each ranking what the others scored; ``tickets``: int32 [2 * B * Hkv] or more, zero, the
    rows' counts of finished programs, which the launches leave zero (a persistent buffer
    keeps a memset out of the step; None: a new one). ``max_budget``: the widest budget of any
    row (sizes the candidate scratch; default the widest of ``budgets``, read with a host sync)."""
    if resolve_impl(impl, q.device) == "torch":
        return coarse_select_ref(q, kmin, kmax, cmin, cmax, pages, num_pages, sink_pages, local_pages, budgets,
                                 width, group_pages, factor, held, margin, dense_rows)
    _check(q, kmin, cmin, pages, num_pages, budgets, group_pages, factor)
    if q.device.type != "cuda" and not interpreter_requested():
        raise ValueError("the Triton two-level Select needs CUDA tensors (or TRITON_INTERPRET=1); use coarse_select_ref")
    B, H, D = q.shape
    hkv, P, GP = kmin.shape[1], pages.shape[1], group_pages
    dev = q.device
    want = torch.empty(B, hkv, width, dtype=torch.int64, device=dev)
    count = torch.empty(B, hkv, dtype=torch.int64, device=dev)
    if B == 0 or P == 0:
        return want.fill_(-1), count.zero_()
    _check_layout(kmin, kmax, cmin, cmax)
    if max_budget is None:
        max_budget = int(_budgets(budgets, dense_rows, P).max())
    PG = -(-P // GP)
    # Every row's candidates fit C: the widest budget's groups (a row's kept groups are capped
    # at C / GP in the kernel; dense rows' budgets already cover their pages, as SelectPlan's).
    C = max(GP, coarse_candidates(max_budget, P, GP, factor))
    rows = B * hkv
    gs = torch.empty(rows, PG, dtype=torch.float32, device=dev)
    kg = torch.empty(rows, PG, dtype=torch.int32, device=dev)
    cs = torch.empty(rows, C, dtype=torch.float32, device=dev)
    ci = torch.empty(rows, C, dtype=torch.int32, device=dev)
    has_held = held is not None and bool(margin)
    held_arg = held.contiguous().view(torch.uint8) if has_held else cs
    dense_arg = dense_rows.contiguous().view(torch.uint8) if dense_rows is not None else cs
    budgets = budgets.contiguous()
    g = H // hkv
    c_pad, c_tail, _ = row_tiles(C)
    shape = dict(HKV=hkv, G=g, G_PAD=next_pow2(g), D=D, D_PAD=max(16, next_pow2(D)), GP=GP,
                 HAS_DENSE=dense_rows is not None, HAS_HELD=has_held)
    pg_pad = max(16, next_pow2(PG))
    e_pad = max(16, next_pow2(max(sink_pages, local_pages, 1)))
    if not split:
        _kernels()._coarse_select[(rows,)](
            q, kmin, kmax, cmin, cmax, pages, num_pages, budgets, dense_arg, held_arg,
            gs, kg, cs, ci, want, count,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), cmin.stride(0), cmin.stride(1), pages.stride(0),
            P, PG, width, C, cmin.shape[0] - 1, sink_pages, local_pages, factor, float(margin),
            TILE=_TILE, PG_PAD=pg_pad, C_PAD=c_pad, C_TAIL=c_tail, E_PAD=e_pad, num_warps=_WARPS, **shape,
        )
        return want, count
    if tickets is None:
        tickets = torch.zeros(2 * rows, dtype=torch.int32, device=dev)
    elif tickets.dtype != torch.int32 or tickets.numel() < 2 * rows:
        raise ValueError(f"tickets must be int32 with at least {2 * rows} entries; got {tickets.dtype} "
                         f"[{tickets.numel()}]")
    m = torch.empty(rows, dtype=torch.int32, device=dev)
    gt = _SPREAD_GROUPS
    s1 = -(-PG // gt)
    k = _kernels()
    k._coarse_groups[(rows, s1)](
        q, cmin, cmax, kmin, kmax, pages, num_pages, budgets, dense_arg, held_arg, gs, kg, m, tickets,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), cmin.stride(0), cmin.stride(1), pages.stride(0),
        P, PG, C, cmin.shape[0] - 1, s1, sink_pages, local_pages, factor, float(margin),
        GT=gt, PG_PAD=pg_pad, num_warps=_SPREAD_WARPS[0], **shape,
    )
    ct = _SPREAD_PAGES
    s2 = -(-C // ct)
    k._coarse_pages[(rows, s2)](
        q, kmin, kmax, pages, num_pages, budgets, dense_arg, held_arg, kg, m, cs, ci, want, count, tickets[rows:],
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), pages.stride(0),
        P, PG, width, C, s2, sink_pages, local_pages, float(margin),
        CT=ct, TILE=_TILE, C_PAD=c_pad, C_TAIL=c_tail, E_PAD=e_pad, num_warps=_SPREAD_WARPS[1], **shape,
    )
    return want, count
