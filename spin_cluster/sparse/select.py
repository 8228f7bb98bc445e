"""Select, the system's half: from page scores to the pages each head attends to.

For a request of n pages (the last, the tail, possibly partial)::

    page:   0 .. sink-1 | sink .. n-local-1          | n-local .. n-1
            sink pages  | middle: top `budget` pages | local window (tail last)
                          by the algorithm's scores

Selected pages are listed per (request, KV head) in ascending page order, padded with -1,
so the tail page is always the last valid entry and a head attends to
``(num_selected - 1) * S + tail_len`` tokens. Budgets may differ per head. All of it is
fixed-shape tensor work on the device.

Two rules pick the middle pages:

    top-k   (default) each head takes its ``budget_pages`` best pages
    top-p   (``top_p`` set) each head takes the fewest best pages whose share of its middle
            pages' estimated attention mass reaches ``top_p``, so heads with peaked attention
            take few pages and heads with flat attention many; a request's heads take at most
            ``sum(budget_pages[b])`` pages in all (the same total as top-k), the least massive
            wanted pages dropped first. A head may take up to that whole total, so
            ``max_budget`` must allow for it.

Under the budget floor (``dense_rows``) a request takes every middle page, whatever the rule
and whether the algorithm scores pages at all: a short context runs dense.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spin_cluster.kernels.page_select import MAX_ROW_PAGES, select_ragged

if TYPE_CHECKING:
    from spin_cluster.sparse.contract import SparseAlgorithm


@dataclass(frozen=True)
class SelectPlan:
    num_pages: torch.Tensor  # [B] int64 pages in context, tail included
    tail_len: torch.Tensor  # [B] int32 tokens in the tail page, 1..S
    sink_pages: int
    local_pages: int
    budget_pages: torch.Tensor  # [B, Hkv] int64 middle pages each head may take
    max_pages: int  # P: pages of the longest request in the batch
    max_budget: int  # K_mid: most middle pages of any head in the batch
    # Top-p mass in (0, 1]; None: top-k. Scores times score_scale are read as log attention
    # mass (up to a constant per head), e.g. 1 / (G sqrt(D)) for q.k summed over G query heads.
    top_p: float | None = None
    score_scale: float = 1.0
    # [B] bool: requests at or under the budget floor (``sparse.budget_floor_tokens``), which
    # take every middle page whatever the rule (their budget_pages cover them too); None: off.
    dense_rows: torch.Tensor | None = None

    @property
    def budget_width(self) -> int:
        """W: a head's most pages under a budget (sink + widest middle + local, at most P)."""
        return min(self.max_pages, self.sink_pages + self.max_budget + self.local_pages)


def select_layer(algorithm: SparseAlgorithm, layer: int, q: torch.Tensor, rows: torch.Tensor, plan: SelectPlan,
                 resident: torch.Tensor | None = None, resident_margin: float = 0.0,
                 fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Select for one layer of a decode step, whole: the algorithm's page scores for the
    queries q [B, H, D] of table rows [B], the hysteresis, then ``select_pages``. Returns
    (want [B, Hkv, K] page ids with -1 padding, num_selected [B, Hkv]).

    Hysteresis (``sparse.options.resident_margin`` > 0): pages the GPU buffer holds now
    (``resident`` [B, Hkv, plan.max_pages] bool) score that many attention logits more, so that
    a page near the cut does not leave and come back step after step.

    Under the top-k rule an algorithm may do all of it in its own kernels
    (``SparseAlgorithm.select_top``: Quest on CUDA, where it is faster), with the same result;
    ``fused=True`` takes the algorithm's kernels wherever it has them, ``fused=False`` the
    separate steps (what the tests and ``benchmarks/bench_select.py`` compare).
    """
    scores = None
    if not algorithm.selects_all:
        # Scores are q.k summed over the G query heads of a KV head: a logit times G sqrt(D).
        logit_scale = algorithm.num_kv_heads / (q.shape[1] * q.shape[2] ** 0.5)
        margin = resident_margin / logit_scale if resident_margin and resident is not None else 0.0  # score units
        if fused is not False and plan.top_p is None and plan.max_budget > 0:
            picked = algorithm.select_top(layer, q, rows, plan, resident if margin else None, margin,
                                          force=fused is True)
            if picked is not None:
                return picked
        scores = algorithm.score(layer, q, rows, plan.max_pages)
        if margin:
            scores = scores + (resident * margin).to(scores.dtype)
        if plan.top_p is not None:
            plan = dataclasses.replace(plan, score_scale=logit_scale)
    return select_pages(scores, algorithm.selects_all, plan, algorithm.num_kv_heads)


def select_pages(scores: torch.Tensor | None, select_all: bool, plan: SelectPlan, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (want [B, Hkv, K] int64 page ids with -1 padding, num_selected [B, Hkv]).

    scores: [B, Hkv, P] from the algorithm, or None (no middle pages unless select_all).
    """
    B, P = plan.num_pages.shape[0], plan.max_pages
    budget_width = plan.budget_width
    if (scores is not None and scores.is_cuda and not select_all and plan.max_budget > 0
            and plan.top_p is None and P <= MAX_ROW_PAGES):
        # The top-k rule below, fused into one Triton launch (same result, tested equal).
        return select_ragged(scores, plan.num_pages, plan.sink_pages, plan.local_pages, plan.budget_pages,
                             budget_width)
    dev = plan.num_pages.device
    p = torch.arange(P, device=dev)  # [P]
    n = plan.num_pages[:, None, None]  # [B, 1, 1]
    in_ctx = p < n  # [B, 1, P]
    is_sink = p < plan.sink_pages
    is_local = p >= n - plan.local_pages
    is_mid = in_ctx & ~is_sink & ~is_local  # [B, 1, P]
    if select_all:
        mid = is_mid.expand(B, num_kv_heads, P)
        width = P
    elif scores is None or plan.max_budget == 0:
        mid = torch.zeros(B, num_kv_heads, P, dtype=torch.bool, device=dev)
        width = min(P, plan.sink_pages + plan.local_pages)
    elif plan.top_p is not None:
        mid, width = _top_p_middle(scores, is_mid, plan), budget_width
    else:
        mid, width = _top_middle(scores, is_mid, plan), budget_width
    if plan.dense_rows is not None and not select_all:
        mid, width = mid | (is_mid & plan.dense_rows[:, None, None]), budget_width
    keep = (in_ctx & (is_sink | is_local)) | mid  # [B, Hkv, P]
    pos = keep.cumsum(-1) - 1  # [B, Hkv, P] position in the compacted list
    want = torch.full((B, num_kv_heads, width + 1), -1, dtype=torch.long, device=dev)
    want.scatter_(-1, torch.where(keep, pos, width), p.expand(B, num_kv_heads, P))
    want = want[..., :width]
    return want, keep.sum(-1)


def _top_middle(scores: torch.Tensor, is_mid: torch.Tensor, plan: SelectPlan) -> torch.Tensor:
    """[B, Hkv, P] mask of the top ``budget_pages[b, h]`` middle pages by score."""
    masked = torch.where(is_mid, scores.float(), float("-inf"))  # [B, Hkv, P]
    k = min(plan.max_budget, masked.shape[-1])
    top = masked.topk(k, dim=-1)  # [B, Hkv, k]
    rank = torch.arange(k, device=scores.device)
    ok = (rank < plan.budget_pages[..., None]) & (top.values > float("-inf"))  # [B, Hkv, k]
    mid = torch.zeros_like(is_mid.expand_as(masked))
    mid.scatter_(-1, top.indices, ok)
    return mid


def _top_p_middle(scores: torch.Tensor, is_mid: torch.Tensor, plan: SelectPlan) -> torch.Tensor:
    """[B, Hkv, P] mask of each head's fewest top middle pages reaching mass ``top_p``, at most
    ``budget_pages[b].sum()`` pages per request."""
    B, Hkv, P = scores.shape
    # An infinite score (a page an algorithm forces in) becomes the largest finite logit.
    logits = (scores.float() * plan.score_scale).clamp(max=torch.finfo(torch.float32).max / 2)
    mass = torch.where(is_mid, logits, float("-inf")).softmax(-1).nan_to_num(0.0)  # [B, Hkv, P]
    val, order = mass.sort(dim=-1, descending=True, stable=True)  # [B, Hkv, P]; ties: lower page first
    wanted = (val.cumsum(-1) - val < plan.top_p) & (val > 0)  # mass before the page is short of p
    flat = torch.where(wanted, val, -1.0).flatten(1)  # [B, Hkv * P]
    rank = flat.argsort(dim=-1, descending=True, stable=True).argsort(-1).view(B, Hkv, P)
    total = plan.budget_pages.sum(-1)  # [B] pages the request's heads share
    fits = torch.arange(P, device=scores.device) < plan.max_budget  # no head past the plan's width
    take = wanted & (rank < total[:, None, None]) & fits
    return torch.zeros_like(take).scatter_(-1, order, take)
