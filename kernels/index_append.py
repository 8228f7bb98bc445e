"""Quest's Index: fold new keys into per-block key bounds, one launch per layer.

    kmin, kmax : [N, Hkv, D]   per-block bounds of one layer (float32 or a 16-bit dtype)
    k          : [T, Hkv, D]   the step's new keys
    blocks     : [T] int64     each token's flat block row in kmin/kmax
    positions  : [T] int64     each token's position (a token at a multiple of ``block_tokens``
                               starts its block afresh: whatever an earlier owner left goes)

    kmin[b] = min(kmin[b], k - slack), kmax[b] = max(kmax[b], k + slack)  for every token of b

A 16-bit index rounds outward: ``slack = |k| * 2^-7`` (nearest rounding errs by <= 2^-8
relative for bfloat16, 2^-11 for float16), so the stored bounds stay bounds; float32 adds
none. Tokens of one block must be adjacent in ``blocks`` (as a step's tokens of one request
are). Two implementations, same signature: the Triton kernel (one program per (token, head),
about a dozen torch launches fewer per layer) and :func:`bounds_append_ref`;
:func:`bounds_append` (``impl="auto"``) picks one (``kernels._impl``). A step that appends to
every layer plans once (:func:`plan_bounds_append`, which fixes the choice) and runs
:func:`bounds_append_planned` per layer: the torch steps' plan is a per-step gather map.
This module imports only torch (and Triton, lazily).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._impl import resolve_impl
from ._triton_support import is_interpreted, load_kernel_module, next_pow2

__all__ = ["BoundsAppendPlan", "bounds_append", "bounds_append_planned", "bounds_append_ref", "fold_bounds_ref",
           "fold_plan", "plan_bounds_append", "SLACK_16BIT"]

SLACK_16BIT = 2.0 ** -7


def _slack(dtype: torch.dtype) -> float:
    return 0.0 if dtype == torch.float32 else SLACK_16BIT


def _check(kmin, kmax, k, blocks, positions):
    if kmin.dim() != 3 or kmax.shape != kmin.shape or k.dim() != 3 or k.shape[1:] != kmin.shape[1:]:
        raise ValueError(f"kmin/kmax must be [N, Hkv, D] and k [T, Hkv, D] alike; got {tuple(kmin.shape)}, "
                         f"{tuple(kmax.shape)}, {tuple(k.shape)}")
    T = k.shape[0]
    if blocks.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"blocks and positions must be [T={T}], got {tuple(blocks.shape)}, {tuple(positions.shape)}")


def bounds_append_ref(kmin, kmax, k, blocks, positions, block_tokens: int) -> None:
    _check(kmin, kmax, k, blocks, positions)
    fold_bounds_ref(kmin, kmax, k, *fold_plan(blocks, positions, block_tokens, kmin.shape[0], k.shape[1:]))


def fold_plan(blocks, positions, block_tokens: int, num_rows: int, head_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``fold_bounds_ref`` needs, once per step for every layer: ([T] the block row to
    reset at each token, or the last row (a dump row) where the token does not start its
    block; [T, Hkv, D] each token's block row, expanded like its key)."""
    first = positions % block_tokens == 0  # a block's first token: forget a previous owner
    fresh = torch.where(first, blocks, num_rows - 1)
    return fresh, blocks[:, None, None].expand(-1, *head_shape)


def fold_bounds_ref(kmin, kmax, k, fresh, expanded) -> None:
    """The torch steps of ``bounds_append_ref`` with its step plan (``fold_plan``) given."""
    kmin.index_fill_(0, fresh, float("inf"))
    kmax.index_fill_(0, fresh, float("-inf"))
    k = k.float()
    lo = hi = k
    if kmin.dtype != torch.float32:
        slack = k.abs() * _slack(kmin.dtype)
        lo, hi = (k - slack).to(kmin.dtype), (k + slack).to(kmax.dtype)
    kmin.scatter_reduce_(0, expanded, lo, "amin")
    kmax.scatter_reduce_(0, expanded, hi, "amax")


@dataclass(frozen=True)
class BoundsAppendPlan:
    """One step's append plan for every layer. impl "triton": ``a``, ``b`` are the [T] blocks
    and positions; impl "torch": ``fold_plan``'s [T] fresh rows and [T, Hkv, D] block rows."""

    impl: str
    block_tokens: int
    a: torch.Tensor
    b: torch.Tensor


def plan_bounds_append(blocks, positions, block_tokens: int, num_rows: int, head_shape,
                       impl: str = "auto") -> BoundsAppendPlan:
    """Once per step: ``num_rows`` rows of kmin/kmax (the last a dump row), ``head_shape``
    (Hkv, D); ``impl`` as for ``bounds_append``, decided by the blocks' device."""
    if resolve_impl(impl, blocks.device) == "triton":
        return BoundsAppendPlan("triton", block_tokens, blocks, positions)
    return BoundsAppendPlan("torch", block_tokens, *fold_plan(blocks, positions, block_tokens, num_rows, head_shape))


def bounds_append_planned(kmin, kmax, k, plan: BoundsAppendPlan) -> None:
    if plan.impl == "triton":
        bounds_append(kmin, kmax, k, plan.a, plan.b, plan.block_tokens, impl="triton")
    else:
        fold_bounds_ref(kmin, kmax, k, plan.a, plan.b)


def bounds_append(kmin, kmax, k, blocks, positions, block_tokens: int, *, impl: str = "auto") -> None:
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``)."""
    if resolve_impl(impl, k.device) == "torch":
        return bounds_append_ref(kmin, kmax, k, blocks, positions, block_tokens)
    _check(kmin, kmax, k, blocks, positions)
    kmod = load_kernel_module("_index_append_kernel", "bounds_append", "bounds_append_ref")
    if k.device.type != "cuda" and not is_interpreted(kmod._bounds_append):
        raise ValueError("the Triton index append needs CUDA tensors (or TRITON_INTERPRET=1); use bounds_append_ref")
    T, H, D = k.shape
    if T == 0:
        return
    if k.stride(2) != 1 or kmin.stride(2) != 1 or kmin.stride() != kmax.stride():
        raise ValueError("k, kmin and kmax need contiguous head dims, and kmin/kmax one layout")
    kmod._bounds_append[(T, H)](
        kmin, kmax, k, blocks, positions, T, k.stride(0), k.stride(1), kmin.stride(0), kmin.stride(1),
        BLK=block_tokens, D=D, BLOCK_D=next_pow2(D), SLACK=_slack(kmin.dtype),
    )
