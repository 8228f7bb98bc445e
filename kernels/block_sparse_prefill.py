"""Block-sparse causal prefill attention: each (KV head, query block) attends to a list of
key blocks only.

Layout (the same as the engine's dense prefill, ``prefill_attention``)::

    q           : [n, H, D]        the chunk's queries, at positions cs .. cs + n - 1
    k, v        : [Hkv, T, D]      the request's keys / values at positions 0 .. T - 1,
                                   T >= cs + n (later positions are never read)
    block_ids   : [Hkv, M, K]      int32 key-block indices per (KV head, query block),
                                   ascending, -1 padded after the first num_blocks entries
    num_blocks  : [Hkv, M]         int32, listed blocks per (KV head, query block): ragged
    returns     : [n, H, D]        in q's dtype; H = Hkv * G, query head h reads KV head h // G

Blocks are ``block_size`` positions, aligned to position 0 (not to the chunk), and query
block m of a chunk is key block ``cs // block_size + m``, its *diagonal* block::

    positions   0        bs       2bs       3bs       4bs
    key blocks  |   0    |   1    |    2    |    3    |
    chunk            cs [=========================]  cs + n        (M = 3 query blocks)
    query block          |   0    |    1    |    2    |

A query at position p sees the listed keys at positions <= p (causal). Every query block's
list should hold its diagonal block (selection always keeps it): a query row that sees no
key gets zeros. With every causal block listed this is dense causal attention.

Two implementations with the same signature:

* the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
  FlashAttention-2 tiling, no host sync.
* :func:`block_sparse_prefill_ref` -- pure torch: the block lists as a boolean mask, SDPA.
  The CPU engine path and the test oracle.

:func:`block_sparse_prefill` (``impl="auto"``) picks one (``kernels._impl``: the kernel on
CUDA). The kernel takes head dims up to 256 and blocks of 16..128 positions; other shapes
raise on CUDA (as they did before the launcher chose) rather than silently running the
reference, whose SDPA mask is [Hkv, n, T].

This module imports only torch (and Triton, lazily).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module

__all__ = [
    "block_sparse_prefill",
    "block_sparse_prefill_ref",
    "causal_block_lists",
    "num_query_blocks",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
_MAX_BLOCK_SIZE = 128  # the query tile is one block: [BLOCK_SIZE, D] stays in registers


def num_query_blocks(context_start: int, num_tokens: int, block_size: int) -> int:
    """M: blocks touched by positions context_start .. context_start + num_tokens - 1."""
    return -(-(context_start + num_tokens) // block_size) - context_start // block_size


def causal_block_lists(num_kv_heads: int, context_start: int, num_tokens: int, block_size: int,
                       device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Every causal block of every query block: (block_ids [Hkv, M, J], num_blocks [Hkv, M]),
    J = the last query block's diagonal + 1. The dense oracle of the block lists."""
    first = context_start // block_size
    M = num_query_blocks(context_start, num_tokens, block_size)
    J = first + M
    j = torch.arange(J, device=device, dtype=torch.int32)
    counts = torch.arange(first + 1, J + 1, device=device, dtype=torch.int32)  # [M]
    ids = torch.where(j[None, :] < counts[:, None], j[None, :], -1)  # [M, J]
    return ids.expand(num_kv_heads, M, J).contiguous(), counts.expand(num_kv_heads, M).contiguous()


def _check_inputs(q, k, v, block_ids, num_blocks, context_start, block_size, out):
    """Validate shapes / dtypes / devices; return (n, H, Hkv, G, D, M)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("block_ids", block_ids), ("num_blocks", num_blocks)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [n, H, D] and k, v [Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    n, H, D = q.shape
    Hkv, T, Dk = k.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D}, k/v have D={Dk}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads Hkv={Hkv}")
    if context_start < 0 or T < context_start + n:
        raise ValueError(f"k/v hold {T} positions; the chunk needs context_start + n = {context_start + n}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: use a power of two >= 16")
    M = num_query_blocks(context_start, n, block_size)
    if block_ids.dim() != 3 or tuple(block_ids.shape[:2]) != (Hkv, M):
        raise ValueError(f"block_ids must be [Hkv={Hkv}, M={M}, K], got {tuple(block_ids.shape)}")
    if tuple(num_blocks.shape) != (Hkv, M):
        raise ValueError(f"num_blocks must be [Hkv={Hkv}, M={M}], got {tuple(num_blocks.shape)}")
    if block_ids.dtype != torch.int32 or num_blocks.dtype != torch.int32:
        raise ValueError(f"block_ids and num_blocks must be int32, got {block_ids.dtype}, {num_blocks.dtype}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of float32/bfloat16/float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("k", k), ("v", v), ("block_ids", block_ids), ("num_blocks", num_blocks)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if out is not None and (tuple(out.shape) != (n, H, D) or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {(n, H, D)} on {q.device}")
    return n, H, Hkv, H // Hkv, D, M


def _resolve_scale(scale, D):
    return D**-0.5 if scale is None else float(scale)


# --------------------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------------------


def block_sparse_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
                             num_blocks: torch.Tensor, context_start: int, block_size: int,
                             scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch block-sparse prefill (same contract as :func:`block_sparse_prefill`): the
    block lists become a [Hkv, n, T'] boolean mask (T' = cs + n) for one SDPA call with the
    KV heads as the batch and their G query heads as the heads."""
    n, H, Hkv, G, D, M = _check_inputs(q, k, v, block_ids, num_blocks, context_start, block_size, out)
    total = context_start + n
    dev = q.device
    J = -(-total // block_size)
    first = context_start // block_size
    K = block_ids.shape[2]
    listed = torch.arange(K, device=dev) < num_blocks[..., None]  # [Hkv, M, K]
    ids = torch.where(listed & (block_ids >= 0) & (block_ids < J), block_ids.long(), J)
    on = torch.zeros(Hkv, M, J + 1, dtype=torch.bool, device=dev)
    on.scatter_(-1, ids, True)  # [Hkv, M, J+1], column J absorbs padding
    q_pos = torch.arange(context_start, total, device=dev)  # [n]
    key = torch.arange(total, device=dev)  # [T']
    row_block = q_pos // block_size - first  # [n] query block of each row
    mask = on[:, row_block][..., key // block_size] & (key[None, :] <= q_pos[:, None])  # [Hkv, n, T']
    o = F.scaled_dot_product_attention(
        q.reshape(n, Hkv, G, D).permute(1, 2, 0, 3),  # [Hkv, G, n, D]
        k[:, None, :total].to(q.dtype),  # [Hkv, 1, T', D]
        v[:, None, :total].to(q.dtype),
        attn_mask=mask[:, None],  # [Hkv, 1, n, T']
        scale=_resolve_scale(scale, D),
        enable_gqa=True,
    )  # [Hkv, G, n, D]
    o = o.permute(2, 0, 1, 3).reshape(n, H, D)
    o = torch.where(mask.any(-1).T.repeat_interleave(G, dim=1)[..., None], o, 0.0)  # rows with no key: 0
    if out is None:
        return o
    out.copy_(o)
    return out


# --------------------------------------------------------------------------------------
# Triton kernel launcher
# --------------------------------------------------------------------------------------


def _load_kernels():
    return load_kernel_module("_block_sparse_prefill_kernel", "block_sparse_prefill", "block_sparse_prefill_ref")


def _launch_config(block_size: int, D_PAD: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages): FlashAttention-2's forward tiles for Hopper at
    D <= 128 (a 128-row Q tile over 8 warps, 64-key K/V tiles, 3-stage pipeline); smaller
    query blocks take 4 warps, larger heads shorter K/V tiles to stay in registers."""
    block_n = min(64 if D_PAD <= 128 else 32, block_size)
    num_warps = 8 if block_size >= 128 else 4
    return block_n, num_warps, 3 if D_PAD <= 128 else 2


def block_sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
                         num_blocks: torch.Tensor, context_start: int, block_size: int,
                         scale: float | None = None, out: torch.Tensor | None = None, *,
                         block_n: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, tma: bool | None = None,
                         impl: str = "auto") -> torch.Tensor:
    """Triton block-sparse prefill; see the module docstring for the layout. ``block_size``
    is 16..128 here (the query tile is one block). Keyword-only tuning knobs: ``block_n``
    (keys per inner tile, a power of two dividing block_size), ``num_warps``, ``num_stages``,
    ``tma`` (K/V through tensor descriptors: True, False, None = where ``descriptors_usable``);
    with none given, a CUDA launch uses the autotuned tile (``autotune_enabled``), timing the
    descriptor loads against pointer loads where descriptors are usable.

    Not checked (it would need a host sync): listed ids lie in 0 .. the query block's
    diagonal block, ascending, and ``0 <= num_blocks <= K``. ``impl``: "auto", "triton"
    or "torch" (the reference; the tuning knobs are then unused)."""
    if resolve_impl(impl, q.device) == "torch":
        return block_sparse_prefill_ref(q, k, v, block_ids, num_blocks, context_start, block_size, scale, out)
    n, H, Hkv, G, D, M = _check_inputs(q, k, v, block_ids, num_blocks, context_start, block_size, out)
    if D > _MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} > {_MAX_HEAD_DIM} is not supported by the kernel")
    if block_size > _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size}: the kernel takes 16..{_MAX_BLOCK_SIZE}; "
                         "use block_sparse_prefill_ref for larger blocks")
    for name, t in (("q", q), ("k", k), ("v", v), ("block_ids", block_ids)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    kmod = _load_kernels()
    interpreted = interpreter_requested()
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); on the CPU set "
                         "TRITON_INTERPRET=1 before Triton is imported, or use block_sparse_prefill_ref")
    D_PAD = max(16, 1 << (D - 1).bit_length())
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1) or block_size % block_n):
        raise ValueError(f"block_n={block_n}: use a power of two >= 16 that divides block_size={block_size}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    fixed = interpreted or block_n is not None or num_warps is not None or num_stages is not None or tma is not None
    tuned = not fixed and block_size >= kmod.AUTOTUNE_MIN_BLOCK and autotune_enabled()
    if tma and not _descriptors_possible(q, k, v):
        raise ValueError("tma=True: K/V tensor descriptors need bf16/fp16, a power-of-two head dim >= 16, 16-byte "
                         "aligned base and strides, and compute capability >= 9.0 (or the interpreter)")
    # Descriptors when asked for, or (tuned launches) where usable: then the tuner times both.
    use_desc = bool(tma) or (tuned and tma is None and descriptors_usable(q, k, v))
    default_n, default_warps, default_stages = _launch_config(block_size, D_PAD)
    descs = _descriptors(k, v, n + context_start, block_n or default_n) if use_desc else None
    args = (q, k, v, block_ids, num_blocks, out, *(descs or (k, v)),
            _resolve_scale(scale, D) * _LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            block_ids.stride(0), block_ids.stride(1), num_blocks.stride(0), num_blocks.stride(1),
            out.stride(0), out.stride(1),
            n, context_start, M, size_class(M))
    meta = dict(G=G, D=D, D_PAD=D_PAD, BLOCK_SIZE=block_size,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRETED=interpreted)
    if not tuned:
        kmod._block_sparse_prefill_fwd[(H, M)](
            *args, **meta, BLOCK_N=default_n if block_n is None else block_n, USE_DESC=use_desc,
            num_warps=default_warps if num_warps is None else num_warps,
            num_stages=default_stages if num_stages is None else num_stages,
        )
    elif use_desc:
        kmod._block_sparse_prefill_fwd_tuned_desc[(H, M)](*args, **meta)
    else:
        kmod._block_sparse_prefill_fwd_tuned[(H, M)](*args, **meta, USE_DESC=False)
    return out


def _descriptors(k: torch.Tensor, v: torch.Tensor, num_keys: int, block_n: int):
    """[Hkv, num_keys, D] tensor descriptors of k and v with [1, block_n, D] blocks (keys past
    num_keys read as zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    Hkv, _, D = k.shape
    return tuple(TensorDescriptor(t, [Hkv, num_keys, D], list(t.stride()), [1, block_n, D]) for t in (k, v))


def _descriptors_possible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """bf16/fp16, head dim a power of two >= 16, 16-byte aligned base and strides, and compute
    capability >= 9.0 (bulk tensor copies) or the interpreter."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    D = k.shape[-1]
    if D < 16 or D & (D - 1):
        return False
    for t in (k, v):
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return interpreter_requested() or (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) >= (9, 0))


def descriptors_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether tuned launches may read K/V through tensor descriptors: possible here
    (``_descriptors_possible``), ``SPIN_PREFILL_TMA`` not 0, and the device's one-time
    self-check (``_descriptor_self_check``) passed."""
    if os.environ.get("SPIN_PREFILL_TMA", "1") == "0" or not _descriptors_possible(q, k, v):
        return False
    return _descriptor_self_check(q.device, q.dtype, k.shape[-1])


@functools.lru_cache(maxsize=None)
def _descriptor_self_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Run the descriptor kernel once on a small ragged problem against the pointer kernel;
    on any error or difference, warn and keep the pointer kernel for this process."""
    g = torch.Generator(device=device).manual_seed(0)
    n, cs, H, Hkv, bs = 200, 72, 4, 2, 64
    q = torch.randn(n, H, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(Hkv, cs + n, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(Hkv, cs + n, head_dim, device=device, dtype=dtype, generator=g)
    ids, counts = causal_block_lists(Hkv, cs, n, bs, device)
    try:
        want = block_sparse_prefill(q, k, v, ids, counts, cs, bs, block_n=32, num_warps=4, num_stages=2, tma=False)
        got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, block_n=32, num_warps=4, num_stages=2, tma=True)
        ok = bool((got.float() - want.float()).abs().max() <= 2e-2)
    except Exception as err:  # a compiler or driver error: any of them means "not on this device"
        warnings.warn(f"block-sparse prefill: K/V tensor descriptors fail on {device} ({type(err).__name__}: {err}); "
                      "using pointer loads", RuntimeWarning, stacklevel=2)
        return False
    if not ok:
        warnings.warn(f"block-sparse prefill: K/V tensor descriptors give wrong results on {device}; using pointer "
                      "loads", RuntimeWarning, stacklevel=2)
    return ok


def size_class(num_q_blocks: int) -> int:
    """Autotune bucket of a launch by its query blocks M: < 64, < 512, more (a 2K warm-up
    prompt, 32K, 128K at 128-position blocks each get their own tile)."""
    return 0 if num_q_blocks < 64 else 1 if num_q_blocks < 512 else 2


def autotune_enabled() -> bool:
    """Whether CUDA launches without explicit knobs pick their tile by timing candidates on
    the first launch (``SPIN_PREFILL_AUTOTUNE=0`` keeps the fixed ``_launch_config``)."""
    return os.environ.get("SPIN_PREFILL_AUTOTUNE", "1") != "0"


def tuned_config(block_size: int, head_dim: int, group: int) -> dict[int, dict]:
    """The tiles the autotuner chose for this shape in this process, by size class
    (``USE_DESC``: K/V through tensor descriptors)."""
    kmod = _load_kernels()
    D_PAD = max(16, 1 << (head_dim - 1).bit_length())
    out = {}
    for name in ("_block_sparse_prefill_fwd_tuned", "_block_sparse_prefill_fwd_tuned_desc"):
        for key, cfg in (getattr(getattr(kmod, name, None), "cache", None) or {}).items():
            if tuple(key[:3]) == (block_size, D_PAD, group):
                out[key[3]] = {"BLOCK_N": cfg.kwargs["BLOCK_N"], "USE_DESC": cfg.kwargs.get("USE_DESC", False),
                               "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return out
