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


def write_tokens_ref(dst_k, dst_v, k, v, slots, also=None) -> None:
    _check(dst_k, dst_v, k, v, slots)
    D = dst_k.shape[2]
    keep = slots >= 0
    idx = slots[keep].to(dst_k.device)
    dst_k.view(-1, D).index_copy_(0, idx, k[keep].to(dst_k.device))
    dst_v.view(-1, D).index_copy_(0, idx, v[keep].to(dst_v.device))
    if also is not None:
        write_tokens_ref(*also[:2], k, v, also[2])


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _write_tokens(dk, dv, k, v, slots, stride_k, stride_v, ak, av, also_slots,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, ALSO: tl.constexpr):
        # int64: a long prefill chunk writes many rows, and i * stride_k must not wrap.
        i = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        slot = tl.load(slots + i).to(tl.int64)
        if slot >= 0:
            tl.store(dk + slot * D + offs, tl.load(k + i * stride_k + offs, mask=m), mask=m)
            tl.store(dv + slot * D + offs, tl.load(v + i * stride_v + offs, mask=m), mask=m)
        if ALSO:
            slot = tl.load(also_slots + i).to(tl.int64)
            if slot >= 0:
                tl.store(ak + slot * D + offs, tl.load(k + i * stride_k + offs, mask=m), mask=m)
                tl.store(av + slot * D + offs, tl.load(v + i * stride_v + offs, mask=m), mask=m)

    return _write_tokens


def check_also(also, k, v) -> None:
    """``also``: (dst_k, dst_v, slots), a second destination of the same rows, e.g. the GPU
    home pages beside the host tier (each row has a slot >= 0 in at most one of them, in
    practice), in the rows' own dtype."""
    _check(also[0], also[1], k, v, also[2])


def write_tokens(dst_k, dst_v, k, v, slots, also=None, *, impl: str = "auto") -> None:
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``), decided by k's device.
    ``also`` (``check_also``): the same rows to a second destination in the same launch."""
    if resolve_impl(impl, k.device) == "torch":
        return write_tokens_ref(dst_k, dst_v, k, v, slots, also)
    _check(dst_k, dst_v, k, v, slots)
    if also is not None:
        check_also(also, k, v)
    if k.shape[0] == 0:
        return
    if k.stride(1) != 1 or v.stride(1) != 1:
        raise ValueError("k/v rows must be contiguous")
    D = dst_k.shape[2]
    ak, av, also_slots = also if also is not None else (dst_k, dst_v, slots)
    _kernel()[(k.shape[0],)](
        dst_k, dst_v, k, v, slots, k.stride(0), v.stride(0), ak, av, also_slots,
        D=D, BLOCK_D=1 << max(0, (D - 1).bit_length()), ALSO=also is not None,
    )
