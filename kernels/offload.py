"""Offload: write token rows of K/V into pages of another tier in one launch.

    dst_k, dst_v : [N, S, D]   pages (e.g. the pinned host tier: every page's home)
    k, v         : [M, D]      new K/V rows (e.g. this step's tokens, on the GPU)
    slots        : [M]         int64 flat token slot page * S + offset; < 0 skips the row

On CUDA the destination may be pinned host memory: the kernel stores through unified
addressing, so a decode step writes its new token through to the host page without a
``cudaMemcpy`` or a host sync, and prefill writes a whole chunk the same way. Two
implementations with the same signature: the Triton kernel and :func:`write_tokens_ref`;
:func:`write_tokens` (``impl="auto"``) picks by the rows' device: the kernel when k is on
CUDA (whatever tier the pages are in), the reference otherwise (``kernels._impl``).

This module imports only torch (and Triton, lazily).
"""

from __future__ import annotations

import functools

import torch

from ._impl import resolve_impl

__all__ = ["write_tokens", "write_tokens_ref"]


def _check(dst_k, dst_v, k, v, slots):
    if dst_k.dim() != 3 or dst_v.shape != dst_k.shape:
        raise ValueError(f"dst_k/dst_v must both be [N, S, D], got {tuple(dst_k.shape)} / {tuple(dst_v.shape)}")
    D = dst_k.shape[2]
    if k.dim() != 2 or k.shape != v.shape or k.shape[1] != D:
        raise ValueError(f"k/v must both be [M, {D}], got {tuple(k.shape)} / {tuple(v.shape)}")
    if slots.dim() != 1 or slots.shape[0] != k.shape[0]:
        raise ValueError(f"slots must be [M={k.shape[0]}], got {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    if k.dtype != dst_k.dtype or v.dtype != dst_v.dtype:
        raise ValueError(f"k/v dtype {k.dtype} must match the pages' {dst_k.dtype}")
    if not (dst_k.is_contiguous() and dst_v.is_contiguous()):
        raise ValueError("dst_k/dst_v must be contiguous")


def write_tokens_ref(dst_k, dst_v, k, v, slots) -> None:
    _check(dst_k, dst_v, k, v, slots)
    D = dst_k.shape[2]
    keep = slots >= 0
    idx = slots[keep].to(dst_k.device)
    dst_k.view(-1, D).index_copy_(0, idx, k[keep].to(dst_k.device))
    dst_v.view(-1, D).index_copy_(0, idx, v[keep].to(dst_v.device))


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _write_tokens(dk, dv, k, v, slots, stride_k, stride_v, D: tl.constexpr, BLOCK_D: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(slots + i).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK_D)
            m = offs < D
            tl.store(dk + slot * D + offs, tl.load(k + i * stride_k + offs, mask=m), mask=m)
            tl.store(dv + slot * D + offs, tl.load(v + i * stride_v + offs, mask=m), mask=m)

    return _write_tokens


def write_tokens(dst_k, dst_v, k, v, slots, *, impl: str = "auto") -> None:
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``), decided by k's device."""
    if resolve_impl(impl, k.device) == "torch":
        return write_tokens_ref(dst_k, dst_v, k, v, slots)
    _check(dst_k, dst_v, k, v, slots)
    if k.shape[0] == 0:
        return
    if k.stride(1) != 1 or v.stride(1) != 1:
        raise ValueError("k/v rows must be contiguous")
    D = dst_k.shape[2]
    _kernel()[(k.shape[0],)](
        dst_k, dst_v, k, v, slots, k.stride(0), v.stride(0), D=D, BLOCK_D=1 << max(0, (D - 1).bit_length())
    )
