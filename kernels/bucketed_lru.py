"""Bucketed LRU victim selection: which buffer slots to evict, per row, with no sort.

The rule the GPU buffer evicts by: the buffer lookup's reference (``buffer_lookup``) picks its
victims with ``bucketed_lru_victims_ref``; its kernel evicts inside the lookup itself. Layout::

    last_use   : [B, N]  int32/int64  step of each slot's last use (row = request or pool)
    evictable  : [B, N]  bool
    now        :         int, or int tensor of 1 or [B] elements, on the slots' device
    num_needed :         int, or int tensor of 1 or [B] elements (< 0 counts as 0)
    returns    : victims [B, N] bool, num_victims [B] int64

    age    = max(now - last_use, 0)
    bucket = min(age // bucket_width, num_buckets - 1)          0 = youngest

Per row, the victims are the first ``min(num_needed, num_evictable)`` evictable slots in
(bucket descending, column ascending) order.

``bucketed_lru_victims_ref`` is pure torch, fixed-shape ops only (no host sync: ``scatter_add_``
instead of ``bincount``, which reads its max on the host on CUDA). A stand-alone Triton kernel
of the same rule, and the rule's policy and exact-LRU baselines, are studies of it
(``spin_cluster.profiling.lru_kernel``, ``spin_cluster.profiling.lru``).

This module imports only torch: it must not import ``spin_cluster``.
"""

from __future__ import annotations

import torch

__all__ = [
    "bucketed_lru_victims_ref",
    "check_inputs",
    "check_slots",
    "row_values",
    "slot_ages",
    "slot_buckets",
]

_INT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------
# Input checks (metadata only: nothing here reads device data)
# --------------------------------------------------------------------------------------


def check_slots(last_use, evictable):
    """``last_use`` [B, N] int32/int64 and ``evictable`` [B, N] bool on one device."""
    if not isinstance(last_use, torch.Tensor) or not isinstance(evictable, torch.Tensor):
        raise ValueError("last_use and evictable must be torch.Tensors")
    if last_use.dim() != 2:
        raise ValueError(f"last_use must be [B, N], got shape {tuple(last_use.shape)}")
    if evictable.shape != last_use.shape:
        raise ValueError(
            f"evictable shape {tuple(evictable.shape)} != last_use shape {tuple(last_use.shape)}"
        )
    if last_use.dtype not in _INT_DTYPES:
        raise ValueError(f"last_use must be int32 or int64, got {last_use.dtype}")
    if evictable.dtype != torch.bool:
        raise ValueError(f"evictable must be bool, got {evictable.dtype}")
    if evictable.device != last_use.device:
        raise ValueError(f"evictable is on {evictable.device}, last_use on {last_use.device}")


def _check_buckets(num_buckets, bucket_width):
    if int(num_buckets) < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if int(bucket_width) < 1:
        raise ValueError(f"bucket_width must be >= 1 step, got {bucket_width}")


def _check_row_value(x, name, num_rows, device):
    if isinstance(x, torch.Tensor):
        if x.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be an int tensor, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the slots are on {device}")
        if x.numel() != 1 and tuple(x.shape) != (num_rows,):
            raise ValueError(
                f"{name} must be a scalar or [B] = [{num_rows}], got shape {tuple(x.shape)}"
            )
    elif isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{name} must be an int or an int tensor, got {type(x).__name__}")


def check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width):
    check_slots(last_use, evictable)
    _check_buckets(num_buckets, bucket_width)
    B = last_use.shape[0]
    _check_row_value(now, "now", B, last_use.device)
    _check_row_value(num_needed, "num_needed", B, last_use.device)


# --------------------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------------------


def row_values(x, name, num_rows, device):
    """An int, or an int tensor of 1 or [B] elements, as a [B] int64 tensor on ``device``."""
    _check_row_value(x, name, num_rows, device)
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).to(torch.int64).expand(num_rows)
    return torch.full((num_rows,), x, dtype=torch.int64, device=device)


def slot_ages(last_use, now):
    """[B, N] int64: max(now - last_use, 0)."""
    now_rows = row_values(now, "now", last_use.shape[0], last_use.device)  # [B]
    return (now_rows[:, None] - last_use).clamp_(min=0)


def slot_buckets(last_use, now, num_buckets, bucket_width=1):
    """[B, N] int64: min(age // bucket_width, num_buckets - 1); 0 = youngest."""
    _check_buckets(num_buckets, bucket_width)
    # min(age // w, nb - 1) == min(age, nb * w - 1) // w: one clamp for both ends.
    span = int(num_buckets) * int(bucket_width) - 1
    return slot_ages(last_use, now).clamp_(max=span).floor_divide_(int(bucket_width))


def _cutoffs(hist, take):
    """Cutoff per row from the bucket histogram.

    ``hist`` [B, 1 + nb] counts evictable slots per key = bucket + 1; key 0 holds the slots
    that are not evictable and is ignored::

        key        0     1 .. nb
                   |     |-- bucket 0 (youngest) .. nb-1 (oldest)
                   `-- not evictable

    Returns ``cut_key`` [B] (cutoff bucket c + 1) and ``take_in_cut`` [B], the number of
    victims that bucket c gives: take minus the evictable slots in buckets > c.
    """
    at_least = hist[:, 1:].flip(1).cumsum(1).flip(1)  # [B, nb] evictable in buckets >= j
    cut = (at_least >= take[:, None]).sum(1) - 1  # [B] in [0, nb-1]: at_least[0] >= take
    padded = torch.nn.functional.pad(at_least, (0, 1))  # [B, nb + 1], at_least[nb] = 0
    older = padded.gather(1, (cut + 1)[:, None])[:, 0]  # [B]
    return cut + 1, take - older


def bucketed_lru_victims_ref(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    num_buckets: int = 64,
    bucket_width: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch bucketed LRU. Returns ``victims`` [B, N] bool and ``num_victims`` [B] int64."""
    check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width)
    B, N = last_use.shape
    nb = int(num_buckets)
    bucket = slot_buckets(last_use, now, nb, bucket_width)  # [B, N]
    key = torch.where(evictable, bucket + 1, 0)  # [B, N] in [0, nb]
    hist = torch.zeros(B, nb + 1, dtype=torch.int64, device=key.device)
    hist.scatter_add_(1, key, torch.ones((), dtype=torch.int64, device=key.device).expand(B, N))
    need = row_values(num_needed, "num_needed", B, key.device)  # [B]
    take = torch.minimum(need.clamp(min=0), hist[:, 1:].sum(1))  # [B]
    cut_key, take_in_cut = _cutoffs(hist, take)  # [B], [B]

    in_cut = key == cut_key[:, None]  # [B, N]
    rank = in_cut.cumsum(1, dtype=torch.int32)  # [B, N] 1-based within the cutoff bucket
    victims = torch.where(in_cut, rank <= take_in_cut[:, None], key > cut_key[:, None])
    return victims, take
