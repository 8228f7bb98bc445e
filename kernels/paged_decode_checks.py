"""Input checks of the paged decode attention's entry points (``paged_decode``: the Triton
kernel and the torch reference; ``paged_decode_cpu``: the CPU's paths), in one place.

This module imports only torch: it must not import ``spin_cluster``.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(q, k_pages, v_pages, block_tables, seq_lens, out, pages_as_q=True):
    """Validate shapes / dtypes / devices; return (B, H, Hkv, G, D, S, P). ``pages_as_q``
    False: the pages may hold another float type than q (a path that widens what it reads)."""
    tensors = {
        "q": q,
        "k_pages": k_pages,
        "v_pages": v_pages,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    if k_pages.dim() != 3:
        raise ValueError(f"k_pages must be [N, S, D], got shape {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}"
        )
    if block_tables.dim() != 3:
        raise ValueError(
            f"block_tables must be [B, Hkv, P], got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() not in (1, 2):
        raise ValueError(f"seq_lens must be [B] or [B, Hkv], got shape {tuple(seq_lens.shape)}")

    B, H, D = q.shape
    N, S, Dk = k_pages.shape
    Bt, Hkv, P = block_tables.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D}, k_pages/v_pages have D={Dk}")
    if D < 1 or S < 1:
        raise ValueError(f"head dim and page size must be >= 1, got D={D}, S={S}")
    if Bt != B:
        raise ValueError(f"block_tables batch {Bt} != q batch {B}")
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens batch {seq_lens.shape[0]} != q batch {B}")
    if seq_lens.dim() == 2 and seq_lens.shape[1] != Hkv:
        raise ValueError(f"seq_lens [B, Hkv] has {seq_lens.shape[1]} heads, block_tables {Hkv}")
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(
            f"number of query heads H={H} must be a multiple of KV heads Hkv={Hkv}"
        )
    if N < 1:
        raise ValueError("k_pages / v_pages hold no page")

    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of float32/bfloat16/float16, got {q.dtype}")
    if k_pages.dtype != v_pages.dtype or (pages_as_q and k_pages.dtype != q.dtype) \
            or k_pages.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"k_pages/v_pages dtype ({k_pages.dtype}/{v_pages.dtype}) must match "
            + (f"q ({q.dtype})" if pages_as_q else "each other and be float32/bfloat16/float16")
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")

    dev = q.device
    for name, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}")

    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (B, H, D):
            raise ValueError(f"out must have shape {(B, H, D)}, got {tuple(out.shape)}")
        if out.dtype != q.dtype:
            raise ValueError(f"out dtype {out.dtype} must match q dtype {q.dtype}")
        if out.device != dev:
            raise ValueError(f"out is on {out.device} but q is on {dev}")
    return B, H, Hkv, H // Hkv, D, S, P


def host_lens(seq_lens: torch.Tensor, capacity: int) -> torch.Tensor:
    """``seq_lens`` on the host as int64 (one sync), each checked to be in 0..``capacity``
    (the block table's P * S tokens)."""
    lens = seq_lens.detach().to("cpu", torch.int64)
    if lens.numel():
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0:
            raise ValueError(f"seq_lens must be >= 0, got min {lo}")
        if hi > capacity:
            raise ValueError(f"seq_len {hi} exceeds block_tables capacity P*S = {capacity}")
    return lens


def resolve_scale(scale, D):
    if scale is None:
        return D**-0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale
