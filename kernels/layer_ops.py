"""Fused element-wise ops of a decoder layer, one launch each where torch takes several:

    add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)   # 1 launch, was 5
    rope_qk(q, k, cos, sin[, v]) -> (q', k'[, contiguous v])            # 1 launch, was 8
    silu_mul(gate, up) -> silu(gate) * up                               # 1 launch, was 2

Shapes: x, residual [T, E]; weight [E]; q [T, H, D], k [T, Hkv, D], cos/sin [T, 1, D]
(sin with rotate_half's sign folded in: ``models.layers.apply_rope``); gate, up [T, F].
``residual`` may be None (normed x, and x itself as the residual).

A decode step at batch 1 is a few hundred such small kernels per layer; even replayed from a
CUDA graph each costs microseconds, so their number bounds the step. Each function has a
``*_ref`` twin in torch with the same rounding to the activation dtype: the references are
what the model runs off CUDA, and what the kernels are tested against (under
``TRITON_INTERPRET=1`` on the CPU). Each launcher takes ``impl="auto"`` (``kernels._impl``:
the kernel on CUDA tensors, the reference elsewhere; "triton" or "torch" to choose).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._impl import resolve_impl
from ._triton_support import load_kernel_module, next_pow2

__all__ = ["add_rms_norm", "add_rms_norm_ref", "rope_qk", "rope_qk_ref", "silu_mul", "silu_mul_ref", "fits"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return load_kernel_module("_layer_ops_kernel", "the fused layer ops", "their *_ref functions")


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def fits(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the model should run the kernels on these tensors: CUDA, a float dtype, and a
    weight of the activations' dtype. (Off CUDA it runs the references; the tests call the
    kernels themselves under the interpreter.)"""
    return x.is_cuda and x.dtype in _DTYPES and (weight is None or weight.dtype == x.dtype)


# ---- references ---------------------------------------------------------------------------------

def add_rms_norm_ref(x, residual, weight, eps: float):
    s = x if residual is None else x + residual
    normed = F.rms_norm(s.to(torch.float32), weight.shape, eps=eps)
    return weight * normed.to(s.dtype), s


def rope_qk_ref(q, k, cos, sin):
    def rope(x):
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    return rope(q), rope(k)


def silu_mul_ref(gate, up):
    return F.silu(gate) * up


# ---- kernels ------------------------------------------------------------------------------------

def add_rms_norm(x, residual, weight, eps: float, *, impl: str = "auto"):
    if resolve_impl(impl, x.device) == "torch":
        return add_rms_norm_ref(x, residual, weight, eps)
    if x.dim() != 2 or weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x must be [T, E] with weight [E] and residual [T, E]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if residual is None else tuple(residual.shape)}")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1) or not weight.is_contiguous():
        raise ValueError("x, residual and weight must be contiguous in their last dimension")
    T, E = x.shape
    out = torch.empty_like(x)
    res_out = x if residual is None else torch.empty_like(x)
    if T:
        _kernels()._add_rms_norm[(T,)](
            x, x if residual is None else residual, weight, out, res_out, E, float(eps),
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=residual is not None, BLOCK=max(16, next_pow2(E)), DT=_tl_dtype(x.dtype),
            num_warps=4 if E <= 2048 else 8,
        )
    return out, res_out


def rope_qk(q, k, cos, sin, v=None, *, impl: str = "auto"):
    """RoPE on q [T, H, D] and k [T, Hkv, D] in one launch. With ``v`` [T, Hkv, D] the same
    launch also copies v into a contiguous tensor, returned third: q/k/v from one fused GEMM
    are strided views of its output, and the KV writes take contiguous rows. impl="torch":
    ``rope_qk_ref`` (and v.contiguous())."""
    if resolve_impl(impl, q.device) == "torch":
        rotated = rope_qk_ref(q, k, cos, sin)
        return rotated if v is None else (*rotated, v.contiguous())
    T, H, D = q.shape
    if k.dim() != 3 or k.shape[0] != T or k.shape[2] != D or cos.shape[-1] != D or sin.shape != cos.shape:
        raise ValueError(f"q [T, H, D], k [T, Hkv, D], cos/sin [T, 1, D] expected; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(cos.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must be shaped like k {tuple(k.shape)}; got {tuple(v.shape)}")
    if D % 2 or any(x.stride(-1) != 1 for x in (q, k, cos, sin) + (() if v is None else (v,))):
        raise ValueError("D must be even and q, k, v, cos, sin contiguous in their last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v_out = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    Hkv = k.shape[1]
    vv, vo = (k, k_out) if v is None else (v, v_out)  # unread without v
    if T and H + Hkv:
        _kernels()._rope_qk[(T, H + Hkv + (0 if v is None else Hkv))](
            q, k, vv, cos, sin, q_out, k_out, vo,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos.stride(0), sin.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), vo.stride(0), vo.stride(1),
            H, Hkv, D=D, D_PAD=max(16, next_pow2(D)), DT=_tl_dtype(q.dtype), num_warps=1,
        )
    return (q_out, k_out) if v is None else (q_out, k_out, v_out)


def silu_mul(gate, up, *, impl: str = "auto"):
    """silu(gate) * up: [T, F] each, rows contiguous; gate and up may be the two halves of one
    [T, 2F] tensor (a fused gate/up GEMM's output) as long as they share its row stride (the
    kernel's condition; the reference takes any)."""
    if resolve_impl(impl, gate.device) == "torch":
        return silu_mul_ref(gate, up)
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 \
            or gate.stride(0) != up.stride(0):
        raise ValueError("gate and up must be [T, F] of one shape and one row stride, rows contiguous")
    T, F_ = gate.shape
    out = torch.empty(T, F_, dtype=gate.dtype, device=gate.device)
    n = out.numel()
    if n:
        block = 1024
        _kernels()._silu_mul[(-(-n // block),)](gate, up, out, n, F_, gate.stride(0), BLOCK=block,
                                                 DT=_tl_dtype(gate.dtype), num_warps=4)
    return out
