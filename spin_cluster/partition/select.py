"""Select, the system's half: from page scores to the pages each head attends to.

For a request of n pages (the last, the tail, possibly partial)::

    page:   0 .. sink-1 | sink .. n-local-1          | n-local .. n-1
            sink pages  | middle: top `budget` pages | local window (tail last)
                          by the algorithm's scores

Selected pages are listed per (request, KV head) in ascending page order, padded with -1,
so the tail page is always the last valid entry and a head attends to
``(num_selected - 1) * S + tail_len`` tokens. Budgets may differ per head. All of it is
fixed-shape tensor work on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spin_cluster.kernels.page_select import topk_ragged


@dataclass(frozen=True)
class SelectPlan:
    num_pages: torch.Tensor  # [B] int64 pages in context, tail included
    tail_len: torch.Tensor  # [B] int32 tokens in the tail page, 1..S
    sink_pages: int
    local_pages: int
    budget_pages: torch.Tensor  # [B, Hkv] int64 middle pages each head may take
    max_pages: int  # P: pages of the longest request in the batch
    max_budget: int  # K_mid: most middle pages of any head in the batch


def select_pages(scores: torch.Tensor | None, select_all: bool, plan: SelectPlan, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (want [B, Hkv, K] int64 page ids with -1 padding, num_selected [B, Hkv]).

    scores: [B, Hkv, P] from the algorithm, or None (no middle pages unless select_all).
    """
    B, P = plan.num_pages.shape[0], plan.max_pages
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
    else:
        mid = _top_middle(scores, is_mid, plan)
        width = min(P, plan.sink_pages + plan.max_budget + plan.local_pages)
    keep = (in_ctx & (is_sink | is_local)) | mid  # [B, Hkv, P]
    pos = keep.cumsum(-1) - 1  # [B, Hkv, P] position in the compacted list
    want = torch.full((B, num_kv_heads, width + 1), -1, dtype=torch.long, device=dev)
    want.scatter_(-1, torch.where(keep, pos, width), p.expand(B, num_kv_heads, P))
    want = want[..., :width]
    return want, keep.sum(-1)


def _top_middle(scores: torch.Tensor, is_mid: torch.Tensor, plan: SelectPlan) -> torch.Tensor:
    """[B, Hkv, P] mask of the top ``budget_pages[b, h]`` middle pages by score."""
    masked = torch.where(is_mid, scores.float(), float("-inf"))  # [B, Hkv, P]
    if masked.is_cuda and masked.shape[-1] <= 16384:
        # Triton: threshold by bisection, no sort; indices ascending, -1 padded.
        idx = topk_ragged(masked, plan.budget_pages, max(1, plan.max_budget))  # [B, Hkv, K]
        P = masked.shape[-1]
        mid = torch.zeros(*masked.shape[:2], P + 1, dtype=torch.bool, device=masked.device)
        mid.scatter_(-1, torch.where(idx >= 0, idx, P), True)
        return mid[..., :P]
    k = min(plan.max_budget, masked.shape[-1])
    top = masked.topk(k, dim=-1)  # [B, Hkv, k]
    rank = torch.arange(k, device=scores.device)
    ok = (rank < plan.budget_pages[..., None]) & (top.values > float("-inf"))  # [B, Hkv, k]
    mid = torch.zeros_like(is_mid.expand_as(masked))
    mid.scatter_(-1, top.indices, ok)
    return mid
