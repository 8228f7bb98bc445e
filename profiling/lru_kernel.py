"""The bucketed LRU rule (``spin_cluster.kernels.bucketed_lru``) as a stand-alone Triton kernel:
a study of victim selection over a million slots, for ``benchmarks/memory.py``. Serving does
not call it: the GPU buffer evicts inside the buffer lookup kernel.

Two implementations with the same signature, picked by :func:`bucketed_lru_victims`'s
``impl="auto"`` (``kernels._impl``: the kernel on CUDA, the reference elsewhere):

* the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; bodies in
  ``_lru_kernel.py``): three launches, each reading the slots at most once; no global atomics,
  no host sync, so it can be captured in a CUDA graph.
* ``bucketed_lru_victims_ref``, pure torch: the CPU path and the test oracle. On a GPU its
  histogram serialises on atomics to the oldest bucket, which is why the kernel exists.
"""

from __future__ import annotations

import torch

from spin_cluster.kernels._impl import resolve_impl
from spin_cluster.kernels._triton_support import is_interpreted, load_kernel_module, next_pow2, triton_importable
from spin_cluster.kernels.bucketed_lru import bucketed_lru_victims_ref, check_inputs

__all__ = ["bucketed_lru_victims", "triton_available"]

_BLOCK = 4096  # slots per program: one histogram and one in-block prefix sum
_BLOCKS_PER_ITER = 64  # block histograms summed per step of the cutoff program
_NUM_WARPS = 4


_KERNELS = ("spin_cluster.profiling._lru_kernel", "bucketed_lru_victims", "bucketed_lru_victims_ref")


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
    check_inputs(last_use, evictable, now, num_needed, num_buckets, bucket_width)
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
