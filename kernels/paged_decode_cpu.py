"""Paged decode attention on the CPU: the pages a step reads gathered per group of requests,
then PyTorch's attention over the gathered K/V. Same layout and contract as
``paged_decode`` (whose checks it shares); every path here reads ``seq_lens`` on the host.

* :func:`paged_decode_attention_sdpa` -- one gather per group and PyTorch's fused CPU
  attention over it (a few operators per layer instead of the reference's ~30).
* :func:`plan_gathered_decode` / :func:`paged_decode_attention_planned` -- the gather's page
  ids and masks built once a step for every layer, then two batched matmuls per group. The
  engine's CPU decode reads the pages in place instead (``cpu_native``, a C kernel) and keeps
  this where that cannot be built.

This module imports only torch: it must not import ``spin_cluster``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged_decode_checks import check_inputs, host_lens, resolve_scale

__all__ = [
    "GatheredDecodePlan",
    "paged_decode_attention_planned",
    "paged_decode_attention_sdpa",
    "plan_gathered_decode",
]

# Gathered K and V bytes per group of requests in paged_decode_attention_sdpa: small groups
# stay in cache between the gather and the attention that reads them. On a 2-core host
# (SmolLM2: Hkv=3, D=64, 576 tokens, fp32) the path takes 0.30 ms a layer at batch 1 against
# the reference's 0.73, 0.9-1.0 against 2.0 at batch 4, and the same ~5 ms at batch 16.
_SDPA_GROUP_BYTES = 8 * 1024 * 1024


def _group_size(num_rows: int, num_kv_heads: int, max_len: int, k_pages: torch.Tensor) -> int:
    """Requests per gather group: as many as keep the group's gathered K and V (``num_kv_heads``
    rows of ``max_len`` tokens each) under ``_SDPA_GROUP_BYTES``, at least one."""
    per_request = 2 * num_kv_heads * max(max_len, 1) * k_pages.shape[-1] * k_pages.element_size()
    return max(1, min(num_rows, _SDPA_GROUP_BYTES // per_request))


def paged_decode_attention_sdpa(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention through ``F.scaled_dot_product_attention`` (same contract as
    :func:`paged_decode_attention`), for the CPU.

    Requests are taken in groups whose gathered K/V stay under ``_SDPA_GROUP_BYTES``. A group
    gathers each (request, KV head) row's pages, padded to the group's longest row, and runs
    one SDPA call in which a KV head's ``G`` query heads are the query rows and a boolean mask
    hides the tokens past each row's length. Rows of length 0 get zeros. Reads ``seq_lens`` on
    the host (one sync), so it is not for CUDA-graph capture.
    """
    B, H, Hkv, G, D, S, P = check_inputs(q, k_pages, v_pages, block_tables, seq_lens, out, pages_as_q=False)
    scale = resolve_scale(scale, D)
    dev = q.device
    result = out if out is not None else torch.empty(B, H, D, dtype=q.dtype, device=dev)
    if B == 0:
        return result
    lens = seq_lens.to(torch.int64)
    lens = lens[:, None].expand(B, Hkv) if lens.dim() == 1 else lens  # [B, Hkv]
    lens_host = host_lens(lens, P * S)
    group = _group_size(B, Hkv, int(lens_host.max()), k_pages)
    row_max = lens_host.max(dim=1).values.tolist()
    for b0 in range(0, B, group):
        b1 = min(B, b0 + group)
        n_pages = -(-max(row_max[b0:b1]) // S)
        if n_pages == 0:
            result[b0:b1].zero_()
            continue
        T, c = n_pages * S, b1 - b0
        row_lens = lens[b0:b1]  # [c, Hkv]
        pages = block_tables[b0:b1, :, :n_pages].long()
        page_ok = torch.arange(n_pages, device=dev) < ((row_lens + S - 1) // S)[..., None]
        ids = torch.where(page_ok, pages, torch.zeros_like(pages)).reshape(-1)  # padding -> page 0
        k = k_pages.index_select(0, ids).view(c, Hkv, T, D).to(q.dtype)  # pages may be narrower (float16)
        v = v_pages.index_select(0, ids).view(c, Hkv, T, D).to(q.dtype)
        # an empty row attends to its first token (no all-masked softmax) and is zeroed below
        visible = torch.arange(T, device=dev) < row_lens.clamp(min=1)[..., None]  # [c, Hkv, T]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b0:b1].view(c, Hkv, G, D), k, v, attn_mask=visible[:, :, None, :], scale=scale)
        o = o.masked_fill((row_lens == 0)[..., None, None], 0.0)
        result[b0:b1].copy_(o.reshape(c, H, D))
    return result


@dataclass(frozen=True)
class _GatherGroup:
    start: int  # first request of the group
    stop: int
    num_tokens: int  # the group's longest row, T
    padded: int  # its pages' tokens, n * S >= T
    ids: tuple[torch.Tensor, ...]  # per layer [c * Hkv * n] int64 page ids (padding: page 0)
    mask: torch.Tensor | None  # [c * Hkv, 1, T] additive (0 or -inf); None when every row has T tokens


@dataclass(frozen=True)
class GatheredDecodePlan:
    """What ``paged_decode_attention_planned`` needs for every layer of one step, built once
    (``plan_gathered_decode``): the page ids to gather per layer and each group's mask.

    On the CPU a decode step's attention is small (at batch 1 about 0.3 ms a layer), and
    building the ids and the length mask anew in every layer cost more than the attention
    (0.69 against 0.27 ms a layer on a 2-core host, SmolLM2 at 576 tokens)."""

    groups: tuple[_GatherGroup, ...]
    num_kv_heads: int


def plan_gathered_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         k_pages: torch.Tensor) -> GatheredDecodePlan:
    """block_tables: [B, L, Hkv, P] (every layer's tables of the step's decode rows);
    seq_lens: [B] tokens of each row, >= 1; k_pages: [N, S, D], the pages to be read (their
    page size, and the bytes a token's K and V take). Requests are grouped as in
    ``paged_decode_attention_sdpa`` (gathered K/V under ``_SDPA_GROUP_BYTES``). Masks are
    float32 whatever the pages' dtype, as the scores are (as the reference computes)."""
    B, L, Hkv, P = block_tables.shape
    S = k_pages.shape[1]
    lens_host = seq_lens.tolist()
    if min(lens_host, default=1) < 1 or max(lens_host, default=0) > P * S:
        raise ValueError(f"seq_lens must be in 1..{P * S}, got {lens_host}")
    lens = seq_lens.to(torch.int64)
    size = _group_size(B, Hkv, max(lens_host, default=1), k_pages)
    groups = []
    for b0 in range(0, B, size):
        b1 = min(B, b0 + size)
        T = max(lens_host[b0:b1])
        n = -(-T // S)
        pages = block_tables[b0:b1, :, :, :n].long()  # [c, L, Hkv, n]
        page_ok = torch.arange(n) < ((lens[b0:b1] + S - 1) // S)[:, None, None, None]
        ids = torch.where(page_ok, pages, torch.zeros_like(pages)).transpose(0, 1).reshape(L, -1)
        mask = None
        if min(lens_host[b0:b1]) < T:
            hidden = torch.arange(T) >= lens[b0:b1, None]  # [c, T]
            mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
            mask = mask[:, None, None, :].expand(-1, Hkv, 1, -1).reshape((b1 - b0) * Hkv, 1, T)
        groups.append(_GatherGroup(b0, b1, T, n * S, ids.unbind(0), mask))
    return GatheredDecodePlan(tuple(groups), Hkv)


def paged_decode_attention_planned(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: GatheredDecodePlan,
    layer: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``layer`` over the pages of a ``GatheredDecodePlan`` (the CPU's
    dense decode path): per group one gather of K and one of V, then two batched matmuls
    and a softmax over each (request, KV head) row, its G query heads as the rows. At batch
    4 this is 3.5x PyTorch's fused CPU attention over the same gathered pages (0.59 against
    2.1 ms a layer, 2 cores, SmolLM2 at 576 tokens), the same at batch 1.

    q: [B, H, D] -> [B, H, D] (into ``out`` when given)."""
    B, H, D = q.shape
    Hkv = plan.num_kv_heads
    G = H // Hkv
    scale = resolve_scale(scale, D)
    result = out if out is not None else torch.empty_like(q)
    for g in plan.groups:
        rows = (g.stop - g.start) * Hkv
        k = k_pages.index_select(0, g.ids[layer]).view(rows, g.padded, D)[:, : g.num_tokens]
        v = v_pages.index_select(0, g.ids[layer]).view(rows, g.padded, D)[:, : g.num_tokens]
        qg = q[g.start : g.stop].reshape(rows, G, D)
        if q.dtype != torch.float32 or k.dtype != torch.float32:  # scores and softmax in float32, as the reference
            qg, k, v = qg.float(), k.float(), v.float()
        if g.mask is None:
            scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [rows, G, T]
        else:
            scores = torch.baddbmm(g.mask, qg, k.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        if result.is_contiguous() and result.dtype == probs.dtype:
            torch.bmm(probs, v, out=result[g.start : g.stop].view(rows, G, D))
        else:
            result[g.start : g.stop] = torch.bmm(probs, v).view(g.stop - g.start, H, D)
    return result
