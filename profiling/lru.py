"""Bucketed LRU eviction on its own: pick victim slots by quantised recency, with fixed-shape
tensor ops, against exact LRU. A study of the rule the GPU buffer evicts by (serving evicts
inside the buffer lookup kernel, ``kernels/buffer_lookup.py``), measured by
``benchmarks/memory.py``.

Every GPU buffer slot carries ``last_use``, the step at which it was last read. When a step
needs free slots, the victims are the least recently used *evictable* slots (not mandatory
for this step; when evicting per request, owned by that request). Sorting a million
timestamps per step is what Spin avoids: recency is quantised into ``num_buckets`` buckets
and the victims follow from a histogram, a cumulative count over the buckets and one prefix
sum over the slots, all of fixed shape. No host sync (no ``.item()``, ``nonzero()``, boolean
indexing, ``bincount`` -- which reads its max on the host on CUDA), so a step that evicts
can be captured in a CUDA graph.

The mechanism: a pure-torch reference of fixed-shape ops (``spin_cluster.kernels.bucketed_lru``,
also the buffer lookup's) and a stand-alone Triton kernel of three launches (``lru_kernel``,
used on CUDA). This module owns the policy's entry points, per pool and per row, and the
exact-LRU baselines.

Semantics (exact; the tests name victim ids by these rules)
-----------------------------------------------------------
Rows are requests, each listing its slots in columns (padding columns are not evictable)::

    last_use   : [B, N]  int32/int64  step of the slot's last use
    evictable  : [B, N]  bool
    now        :         int, or int tensor of 1 or [B] elements: the current step
    num_needed :         int, or int tensor of 1 or [B] elements: victims wanted per row
                         (< 0 counts as 0)

    age    = max(now - last_use, 0)                       (a future last_use has age 0)
    bucket = min(age // bucket_width, num_buckets - 1)    (0 youngest; all old ages collapse
                                                           into the oldest bucket)

Order the evictable slots of a row from older to younger by (bucket descending, column
ascending). The victims are the first ``min(num_needed, num_evictable)`` slots in this order;
``num_victims`` is that count. So within one bucket the lowest columns (slot ids) go first,
and recency differences inside a bucket are ignored. Computed as::

    at_least[j] = evictable slots in buckets >= j          (cumulative from the oldest)
    take        = min(num_needed, at_least[0])
    c           = max{ j : at_least[j] >= take }           (cutoff bucket)
    victims     = every evictable slot in a bucket > c, and in bucket c the first
                  take - at_least[c + 1] evictable slots by column (a prefix sum)

``select_victims_exact`` is exact LRU under the same order with ``bucket`` replaced by
``age`` (ties by column). With ``bucket_width == 1`` and every evictable age
``< num_buckets`` the two select the same slots. In general both take the same number,
and no evictable slot left behind is in an older bucket than a victim.

Entry points: :func:`select_victims` (one pool: ``[N]`` slots, scalar ``num_needed``) and
:func:`select_victims_batched` (rows evicted independently), plus the exact references
:func:`select_victims_exact` / :func:`select_victims_exact_batched` (``torch.sort`` or
``torch.topk``; for tests and benchmarks).
"""

from __future__ import annotations

import torch

from spin_cluster.kernels import bucketed_lru as _mech
from spin_cluster.kernels.bucketed_lru import row_values, slot_ages
from spin_cluster.kvcache.buffer import DEFAULT_NUM_BUCKETS
from spin_cluster.profiling.lru_kernel import bucketed_lru_victims

__all__ = [
    "DEFAULT_NUM_BUCKETS",
    "select_victims",
    "select_victims_batched",
    "select_victims_exact",
    "select_victims_exact_batched",
    "slot_buckets",
]

_AGE_CAP = (1 << 31) - 1  # exact top-k packs (age, column) into one int64 key


def _check_1d(last_use, evictable, num_needed):
    for name, t in (("last_use", last_use), ("evictable", evictable)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{name} must be a [N] tensor (see select_victims_batched for rows)")
    if isinstance(num_needed, torch.Tensor) and num_needed.numel() != 1:
        raise ValueError(
            f"num_needed must be an int or a 1-element tensor, got {tuple(num_needed.shape)}"
        )


# --------------------------------------------------------------------------------------
# Bucketed LRU
# --------------------------------------------------------------------------------------


def slot_buckets(
    last_use: torch.Tensor,
    now: int | torch.Tensor,
    num_buckets: int = DEFAULT_NUM_BUCKETS,
    bucket_width: int = 1,
) -> torch.Tensor:
    """Recency bucket of every slot (same shape as ``last_use``, int64; 0 = youngest)."""
    if last_use.dim() == 1:
        return _mech.slot_buckets(last_use[None], now, num_buckets, bucket_width)[0]
    return _mech.slot_buckets(last_use, now, num_buckets, bucket_width)


def select_victims_batched(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    num_buckets: int = DEFAULT_NUM_BUCKETS,
    bucket_width: int = 1,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucketed LRU per row. Returns ``victim_mask`` [B, N] bool, ``num_victims`` [B] int64.

    See the module docstring for the exact rule. No host sync. ``impl``: ``"triton"`` (three
    launches), ``"torch"`` (fixed-shape torch ops), or ``"auto"`` (Triton on CUDA).
    """
    _mech.check_slots(last_use, evictable)
    return bucketed_lru_victims(last_use, evictable, now, num_needed, num_buckets, bucket_width, impl=impl)


def select_victims(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    num_buckets: int = DEFAULT_NUM_BUCKETS,
    bucket_width: int = 1,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucketed LRU over one pool of slots.

    ``last_use`` [N], ``evictable`` [N], ``num_needed`` an int or a 1-element int tensor.
    Returns ``victim_mask`` [N] bool and ``num_victims`` [] int64. Ties go to lower slot ids.
    """
    _check_1d(last_use, evictable, num_needed)
    victims, taken = select_victims_batched(
        last_use[None], evictable[None], now, num_needed, num_buckets, bucket_width, impl
    )
    return victims[0], taken[0]


# --------------------------------------------------------------------------------------
# Exact LRU references
# --------------------------------------------------------------------------------------


def select_victims_exact_batched(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    method: str = "sort",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LRU per row: oldest ``age`` first, ties by column. Same returns as the bucketed.

    ``method="sort"`` ranks every slot with a stable ``torch.sort`` (no host sync);
    ``method="topk"`` takes ``torch.topk`` of a packed (age, column) key with ``k`` = the
    largest ``num_needed``, which it reads on the host when it is a tensor.
    """
    _mech.check_slots(last_use, evictable)
    B, N = last_use.shape
    age = slot_ages(last_use, now)  # [B, N]
    need = row_values(num_needed, "num_needed", B, last_use.device)  # [B]
    take = torch.minimum(need.clamp(min=0), evictable.sum(1))  # [B]
    if method == "sort":
        rank = _exact_ranks(age, evictable)
        return evictable & (rank < take[:, None]), take
    if method == "topk":
        return _exact_topk(age, evictable, num_needed, take), take
    raise ValueError(f"method must be 'sort' or 'topk', got {method!r}")


def _exact_ranks(age, evictable):
    """[B, N]: position of each slot in (evictable first, age desc, column asc) order."""
    B, N = age.shape
    key = torch.where(evictable, -age, torch.iinfo(torch.int64).max)  # [B, N]
    order = torch.sort(key, dim=1, stable=True).indices  # [B, N] column at each position
    positions = torch.arange(N, device=age.device).expand(B, N)
    return torch.empty_like(order).scatter_(1, order, positions)


def _exact_topk(age, evictable, num_needed, take):
    """Victim mask from top-k of a unique key: older first, then lower column."""
    B, N = age.shape
    need = num_needed.max() if isinstance(num_needed, torch.Tensor) else num_needed
    k = max(0, min(N, int(need)))  # host sync when num_needed is a tensor
    cols = torch.arange(N, device=age.device)
    key = age.clamp(max=_AGE_CAP) * N + (N - 1 - cols)  # [B, N] unique per row
    key = torch.where(evictable, key, -1)
    top = torch.topk(key, k, dim=1).indices  # [B, k]
    picked = torch.arange(k, device=age.device)[None, :] < take[:, None]  # [B, k]
    return torch.zeros(B, N, dtype=torch.bool, device=age.device).scatter_(1, top, picked)


def select_victims_exact(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    method: str = "sort",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LRU over one pool of slots (``[N]`` in, ``[N]`` and ``[]`` out)."""
    _check_1d(last_use, evictable, num_needed)
    victims, take = select_victims_exact_batched(
        last_use[None], evictable[None], now, num_needed, method
    )
    return victims[0], take[0]
