"""The strided block-mass estimate of block-sparse prefill: how much of each query block's
attention each causal key block holds, from group-mean queries against block-mean keys.

Layout (that of ``block_sparse_prefill``)::

    q        : [n, H, D]      the chunk's queries, at positions cs .. cs + n - 1
    k        : [Hkv, >= T, D] keys at positions 0 .. T - 1, T = cs + n
    returns  : [Hkv, M, J]    float32: row (h, m) is query block m's estimated mass over key
                              blocks 0 .. J - 1, 0 right of its diagonal, summing to 1

Blocks are ``block_size`` positions aligned to position 0, query groups ``stride`` positions
(``stride`` divides ``block_size``)::

    query groups  | s | s | s | s | ... (R = M * bs / s; the first and last may be partial)
    key blocks    |      bs       |      bs       | ...  (J)

For each query head, group and key block: the softmax over causal key blocks of
(group-mean q) . (block-mean k) / sqrt(D); a query block's mass over key block j is the sum
over its groups and the KV head's G query heads, each group weighted by the chunk positions
it holds. Means are taken over positions inside the chunk (fp32 sums); the dots run in the
inputs' dtype, the softmax in fp32.

* the Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): one
  program per (KV head, query block), logits kept on chip.
* :func:`strided_block_masses_ref` -- pure torch, chunked over KV heads; the CPU path and
  the test oracle.

:func:`strided_block_masses` (``impl="auto"``) picks one (``kernels._impl``).
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import interpreter_requested, load_kernel_module, next_pow2
from .block_sparse_prefill import num_query_blocks

__all__ = ["block_mean_keys", "strided_block_masses", "strided_block_masses_ref"]

_LOG2E = 1.4426950408889634
_CHUNK_ELEMENTS = 1 << 26  # fp32 logits the torch reference holds at once


def _shape(q: torch.Tensor, k: torch.Tensor, context_start: int, block_size: int, stride: int):
    if q.dim() != 3 or k.dim() != 3 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be [n, H, D] and k [Hkv, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    n, H, D = q.shape
    Hkv = k.shape[0]
    if H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads Hkv={Hkv}")
    if stride < 1 or block_size % stride:
        raise ValueError(f"stride={stride} must divide block_size={block_size}")
    T = context_start + n
    if k.shape[1] < T:
        raise ValueError(f"k holds {k.shape[1]} positions; the chunk needs context_start + n = {T}")
    first = context_start // block_size
    M = num_query_blocks(context_start, n, block_size)
    return n, H, Hkv, H // Hkv, D, first, M, first + M, T


def block_mean_keys(k: torch.Tensor, num_keys: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, J, D] in ``dtype``: the mean of each block's keys among positions < num_keys."""
    Hkv, _, D = k.shape
    J = -(-num_keys // block_size)
    if num_keys % block_size or k.shape[1] < J * block_size:
        padded = k.new_zeros(Hkv, J * block_size, D)
        padded[:, :num_keys] = k[:, :num_keys]
    else:
        padded = k[:, :J * block_size]
    counts = (torch.arange(J * block_size, device=k.device) < num_keys).view(J, block_size).sum(-1).clamp(min=1)
    return (padded.reshape(Hkv, J, block_size, D).sum(2, dtype=torch.float32) / counts[None, :, None]).to(dtype)


def strided_block_masses_ref(q: torch.Tensor, k: torch.Tensor, context_start: int, block_size: int,
                             stride: int) -> torch.Tensor:
    """Pure-torch strided estimate (see the module docstring)."""
    n, H, Hkv, G, D, first, M, J, T = _shape(q, k, context_start, block_size, stride)
    s, bs = stride, block_size
    lead = context_start - first * bs  # chunk rows start this far into query block 0
    q_pad = q
    if lead or n % bs:
        q_pad = q.new_zeros(M * bs, H, D)
        q_pad[lead:lead + n] = q
    R, per = M * bs // s, bs // s
    rows = torch.zeros(M * bs, device=q.device)
    rows[lead:lead + n] = 1
    q_count = rows.view(R, s).sum(-1)  # [R] chunk rows per group
    q_mean = q_pad.reshape(R, s, H, D).sum(1, dtype=torch.float32) / q_count.clamp(min=1)[:, None, None]
    # [Hkv, G*R, D] query groups per KV head, [Hkv, D, J] block keys, in the inputs' dtype.
    qg = q_mean.to(q.dtype).view(R, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * R, D)
    kt = block_mean_keys(k, T, bs, q.dtype).transpose(1, 2)
    row_block = first + torch.arange(R, device=q.device) // per  # [R] each group's diagonal block
    future = torch.arange(J, device=q.device)[None, :] > row_block[:, None]  # [R, J]
    out = torch.empty(Hkv, M, J, dtype=torch.float32, device=q.device)
    heads_per_chunk = max(1, _CHUNK_ELEMENTS // (G * R * J))
    for h0 in range(0, Hkv, heads_per_chunk):
        h1 = min(Hkv, h0 + heads_per_chunk)
        logits = torch.bmm(qg[h0:h1], kt[h0:h1]).float().mul_(D**-0.5).view(h1 - h0, G, R, J)
        p = logits.masked_fill_(future, float("-inf")).softmax(-1).mul_(q_count[:, None])
        out[h0:h1] = p.view(h1 - h0, G, M, per, J).sum((1, 3))
    return out / out.sum(-1, keepdim=True).clamp(min=1e-30)


def strided_block_masses(q: torch.Tensor, k: torch.Tensor, context_start: int, block_size: int,
                         stride: int, *, block_j: int = 64, num_warps: int = 4,
                         num_stages: int = 2, impl: str = "auto") -> torch.Tensor:
    """The strided estimate (see the module docstring); ``block_j`` key blocks a tile (the
    kernel's, as ``num_warps`` and ``num_stages``); ``impl``: "auto", "triton" or "torch"."""
    if resolve_impl(impl, q.device) == "torch":
        return strided_block_masses_ref(q, k, context_start, block_size, stride)
    n, H, Hkv, G, D, first, M, J, T = _shape(q, k, context_start, block_size, stride)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    interpreted = interpreter_requested()
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); on the CPU set "
                         "TRITON_INTERPRET=1 before Triton is imported, or use strided_block_masses_ref")
    kmod = load_kernel_module("_prefill_estimate_kernel", "strided_block_masses", "strided_block_masses_ref")
    k_mean = block_mean_keys(k, T, block_size, q.dtype).contiguous()
    out = torch.zeros(Hkv, M, J, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    per = block_size // stride
    kmod._strided_mass_fwd[(Hkv, M)](
        q, k_mean, out, D**-0.5 * _LOG2E,
        q.stride(0), q.stride(1), k_mean.stride(0), k_mean.stride(1), out.stride(0), out.stride(1),
        n, context_start,
        G=G, S=stride, PER=per, ROWS=max(16, next_pow2(G * per)), D=D, D_PAD=max(16, next_pow2(D)),
        BLOCK_SIZE=block_size, BLOCK_J=block_j,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRETED=interpreted,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
