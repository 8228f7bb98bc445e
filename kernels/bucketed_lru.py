"""Bucketed LRU victim selection: which buffer slots to evict, per row, with no sort.

The policy (what "least recently used" means here, and why buckets) is documented in
``spin_cluster.kvcache.lru``; this module is the mechanism. Layout::

    last_use   : [B, N]  int32/int64  step of each slot's last use (row = request or pool)
    evictable  : [B, N]  bool
    now        :         int, or int tensor of 1 or [B] elements, on the slots' device
    num_needed :         int, or int tensor of 1 or [B] elements (< 0 counts as 0)
    returns    : victims [B, N] bool, num_victims [B] int64

    age    = max(now - last_use, 0)
    bucket = min(age // bucket_width, num_buckets - 1)          0 = youngest

Per row, the victims are the first ``min(num_needed, num_evictable)`` evictable slots in
(bucket descending, column ascending) order.

Two implementations with the same signature, picked by :func:`bucketed_lru_victims`'s
``impl="auto"`` (``kernels._impl``: the kernel on CUDA, the reference elsewhere):

* the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): three launches, each reading the slots at most once; no global
  atomics, no host sync, so it can be captured in a CUDA graph.
* :func:`bucketed_lru_victims_ref` -- pure torch, fixed-shape ops only (no host sync
  either: ``scatter_add_`` instead of ``bincount``, which reads its max on the host on CUDA).
  The CPU path and the test oracle. On a GPU its histogram serialises on atomics to the
  oldest bucket, which is why the kernel exists.

This module imports only torch (and Triton, lazily): it must not import ``spin_cluster``.
"""

from __future__ import annotations


import torch

from ._impl import resolve_impl
from ._triton_support import is_interpreted, load_kernel_module, next_pow2, triton_importable

__all__ = [
    "bucketed_lru_victims",
    "bucketed_lru_victims_ref",
    "check_slots",
    "row_values",
    "slot_ages",
    "slot_buckets",
    "triton_available",
]

_INT_DTYPES = (torch.int32, torch.int64)
_BLOCK = 4096  # slots per program: one histogram and one in-block prefix sum
_BLOCKS_PER_ITER = 64  # block histograms summed per step of the cutoff program
_NUM_WARPS = 4


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


def _check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width):
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
    """Pure-torch bucketed LRU (same contract as :func:`bucketed_lru_victims`)."""
    _check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width)
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


# --------------------------------------------------------------------------------------
# Triton launcher
# --------------------------------------------------------------------------------------


_KERNELS = ("_bucketed_lru_kernel", "bucketed_lru_victims", "bucketed_lru_victims_ref")


def _load_kernels():
    return load_kernel_module(*_KERNELS)


def triton_available() -> bool:
    return triton_importable(*_KERNELS)


def _row_arg(x, dummy):
    """(pointer, scalar, stride, from_ptr) for a per-row value given as int or tensor."""
    if isinstance(x, torch.Tensor):
        return x, 0, (0 if x.numel() == 1 else x.stride(0)), True
    return dummy, x, 0, False


def bucketed_lru_victims(
    last_use: torch.Tensor,
    evictable: torch.Tensor,
    now: int | torch.Tensor,
    num_needed: int | torch.Tensor,
    num_buckets: int = 64,
    bucket_width: int = 1,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucketed LRU. Returns ``victims`` [B, N] bool and ``num_victims`` [B] int64.

    ``impl``: "auto", "triton" or "torch" (``kernels._impl``). The kernel compiles once per
    (N, num_buckets, bucket_width): the block count is a constant.
    """
    if resolve_impl(impl, last_use.device) == "torch":
        return bucketed_lru_victims_ref(last_use, evictable, now, num_needed, num_buckets, bucket_width)
    _check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width)
    for name, t in (("last_use", last_use), ("evictable", evictable)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    kmod = _load_kernels()
    interpreted = is_interpreted(kmod._lru_mark)
    dev = last_use.device
    if dev.type != "cuda" and not interpreted:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors (got {dev}); on the CPU set "
            "TRITON_INTERPRET=1 before Triton is imported, or use bucketed_lru_victims_ref"
        )
    B, N = last_use.shape
    victims = torch.empty(B, N, dtype=torch.bool, device=dev)
    num_victims = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return victims, num_victims
    nb, width = int(num_buckets), int(bucket_width)
    nb_pad = next_pow2(nb)
    block = min(_BLOCK, max(16, next_pow2(N)))
    num_blocks = max(1, -(-N // block))
    hist = torch.empty(B, num_blocks, nb_pad, dtype=torch.int32, device=dev)
    block_off = torch.empty(B, num_blocks, dtype=torch.int32, device=dev)
    cut = torch.empty(B, 2, dtype=torch.int64, device=dev)
    ev_bytes = evictable.view(torch.uint8)
    now_ptr, now_val, stride_now, now_from_ptr = _row_arg(now, num_victims)
    need_ptr, need_val, stride_need, need_from_ptr = _row_arg(num_needed, num_victims)
    span = nb * width - 1

    kmod._lru_block_hist[(num_blocks, B)](
        last_use, ev_bytes, now_ptr, now_val, hist, N,
        last_use.stride(0), ev_bytes.stride(0), stride_now,
        NUM_BLOCKS=num_blocks, NB_PAD=nb_pad, SPAN=span, WIDTH=width,
        NOW_FROM_PTR=now_from_ptr, BLOCK=block, num_warps=_NUM_WARPS,
    )
    kmod._lru_cutoff[(B,)](
        hist, need_ptr, need_val, stride_need, block_off, cut, num_victims,
        NUM_BLOCKS=num_blocks, NB=nb, NB_PAD=nb_pad, NEED_FROM_PTR=need_from_ptr,
        BLOCKS_PER_ITER=_BLOCKS_PER_ITER, num_warps=_NUM_WARPS,
    )
    kmod._lru_mark[(num_blocks, B)](
        last_use, ev_bytes, now_ptr, now_val, block_off, cut, victims.view(torch.uint8), N,
        last_use.stride(0), ev_bytes.stride(0), stride_now,
        NUM_BLOCKS=num_blocks, SPAN=span, WIDTH=width, NOW_FROM_PTR=now_from_ptr,
        BLOCK=block, num_warps=_NUM_WARPS,
    )
    return victims, num_victims
