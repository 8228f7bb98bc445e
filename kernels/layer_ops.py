"""Fused element-wise ops of a decoder layer, one launch each where torch takes several:

    add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)   # 1 launch, was 5
    rope_qk(q, k, cos, sin[, v]) -> (q', k'[, contiguous v])            # 1 launch, was 8
    silu_mul(gate, up) -> silu(gate) * up                               # 1 launch, was 2

Gemma 3 (``models.gemma3``), whose RMSNorm scales by 1 + weight in float32 and rounds once
(launches counted for 16-bit activations):

    gemma_rms_norm(x, weight, eps) -> norm(x)                                  # 1 launch, was 10
    gemma_norm_add_norm(h, x, w_post, w_next, eps) -> (norm_next(x'), x')      # 1 launch, was 21
        x' = x + norm_post(h): a sublayer's post-norm, its residual add, the next pre-norm
    gemma_qk_norm_rope(q, k, cos, sin, q_norm_w, k_norm_w, eps[, q_scale, v])  # 1 launch, was 30
        -> (q', k'[, contiguous v]): per-head norms, RoPE, then q * q_scale
    gelu_tanh_mul(gate, up) -> gelu_tanh(gate) * up                            # 1 launch, was 2

Shapes: x, residual, h [T, E]; weight, w_post, w_next [E]; q [T, H, D], k [T, Hkv, D],
cos/sin [T, 1, D] (sin with rotate_half's sign folded in: ``models.layers.apply_rope``);
q_norm_w, k_norm_w [D]; gate, up [T, F]. ``residual`` may be None (normed x, and x itself as
the residual). The Gemma ops take weights in float32 or in the activations' dtype.

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

__all__ = [
    "add_rms_norm", "add_rms_norm_ref", "rope_qk", "rope_qk_ref", "silu_mul", "silu_mul_ref", "fits",
    "gemma_rms_norm", "gemma_rms_norm_ref", "gemma_norm_add_norm", "gemma_norm_add_norm_ref",
    "gemma_qk_norm_rope", "gemma_qk_norm_rope_ref", "gelu_tanh_mul", "gelu_tanh_mul_ref",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return load_kernel_module("_layer_ops_kernel", "the fused layer ops", "their *_ref functions")


# Launch option of the kernels that round as torch does: no fused multiply-add. With it the
# compiler turns RoPE's x * cos + x.roll * sin into fma(x, cos, x.roll * sin), skipping the
# rounding of a product that torch does (on the H100 a third of float32 and float16 RoPE
# outputs came out an ulp off), and likewise x + norm(h) in float32. The interpreter drops it.
_NO_FMA = {"enable_fp_fusion": False}


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def fits(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the model should run the kernels on these tensors: CUDA, a float dtype, and a
    weight of the activations' dtype (the Gemma ops take float32 weights too: ask without
    one). (Off CUDA it runs the references; the tests call the kernels themselves under the
    interpreter.)"""
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


def gemma_rms_norm_ref(x, weight, eps: float):
    # x: [..., N], weight [N] -> [..., N] in x's dtype: transformers' GemmaRMSNorm
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gemma_norm_add_norm_ref(h, x, w_post, w_next, eps: float):
    x = x + gemma_rms_norm_ref(h, w_post, eps)
    return gemma_rms_norm_ref(x, w_next, eps), x


def gemma_qk_norm_rope_ref(q, k, cos, sin, q_norm_w, k_norm_w, eps: float, q_scale: float | None = None):
    q, k = rope_qk_ref(gemma_rms_norm_ref(q, q_norm_w, eps), gemma_rms_norm_ref(k, k_norm_w, eps), cos, sin)
    return (q if q_scale is None else q * q_scale), k


def gelu_tanh_mul_ref(gate, up):
    return F.gelu(gate, approximate="tanh") * up


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
    return _launch_rope(q, k, cos, sin, v)


def _launch_rope(q, k, cos, sin, v, norms=None, q_scale: float | None = None):
    """``_rope_qk`` over q [T, H, D], k [T, Hkv, D] (shapes checked by the caller), v copied
    when given; ``norms``: (q_norm_w, k_norm_w, eps) of Gemma's per-head norms, or None."""
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must be shaped like k {tuple(k.shape)}; got {tuple(v.shape)}")
    if q.shape[-1] % 2 or any(x.stride(-1) != 1 for x in (q, k, cos, sin) + (() if v is None else (v,))):
        raise ValueError("D must be even and q, k, v, cos, sin contiguous in their last dimension")
    (T, H, D), Hkv = q.shape, k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v_out = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    vv, vo = (k, k_out) if v is None else (v, v_out)  # unread without v
    wq, wk, eps = (q, k, 0.0) if norms is None else norms  # weights unread without norms
    if T and H + Hkv:
        _kernels()._rope_qk[(T, H + Hkv + (0 if v is None else Hkv))](
            q, k, vv, cos, sin, wq, wk, q_out, k_out, vo,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos.stride(0), sin.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), vo.stride(0), vo.stride(1),
            H, Hkv, float(eps), 1.0 if q_scale is None else float(q_scale),
            HAS_NORM=norms is not None, HAS_SCALE=q_scale is not None, D=D, D_PAD=max(16, next_pow2(D)),
            DT=_tl_dtype(q.dtype), num_warps=1, **_NO_FMA,
        )
    return (q_out, k_out) if v is None else (q_out, k_out, v_out)


def silu_mul(gate, up, *, impl: str = "auto"):
    """silu(gate) * up: [T, F] each, rows contiguous; gate and up may be the two halves of one
    [T, 2F] tensor (a fused gate/up GEMM's output) as long as they share its row stride (the
    kernel's condition; the reference takes any)."""
    if resolve_impl(impl, gate.device) == "torch":
        return silu_mul_ref(gate, up)
    return _gated("_silu_mul", gate, up)


def _gated(kernel: str, gate, up):
    """act(gate) * up by the element-wise kernel named (``_silu_mul``, ``_gelu_tanh_mul``)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 \
            or gate.stride(0) != up.stride(0):
        raise ValueError("gate and up must be [T, F] of one shape and one row stride, rows contiguous")
    if gate.dtype not in _DTYPES or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must share a float dtype; got {gate.dtype} and {up.dtype}")
    T, F_ = gate.shape
    out = torch.empty(T, F_, dtype=gate.dtype, device=gate.device)
    n = out.numel()
    if n:
        block = 1024
        getattr(_kernels(), kernel)[(-(-n // block),)](gate, up, out, n, F_, gate.stride(0), BLOCK=block,
                                                       DT=_tl_dtype(gate.dtype), num_warps=4)
    return out


# ---- Gemma 3 kernels ----------------------------------------------------------------------------

def _check_gemma_weights(*weights, n: int) -> None:
    for w in weights:
        if w.shape != (n,) or not w.is_contiguous() or w.dtype not in _DTYPES:
            raise ValueError(f"norm weights must be contiguous [{n}] of a float dtype; got {tuple(w.shape)} {w.dtype}")


def gemma_rms_norm(x, weight, eps: float, *, impl: str = "auto"):
    """GemmaRMSNorm of x [T, E] (rows contiguous, any row stride) with weight [E]."""
    if resolve_impl(impl, x.device) == "torch":
        return gemma_rms_norm_ref(x, weight, eps)
    return _gemma_norm_rows(None, x, weight, weight, eps)[0]


def gemma_norm_add_norm(h, x, w_post, w_next, eps: float, *, impl: str = "auto"):
    """x' = x + norm(h, w_post), then (norm(x', w_next), x'): the residual add of a Gemma
    sublayer's output h [T, E] after its post-norm, and the norm of the next sublayer (or the
    model's final norm) on the sum; one launch. h and x rows contiguous, any row stride; both
    norms take ``eps`` (a model's norms share one)."""
    if resolve_impl(impl, x.device) == "torch":
        return gemma_norm_add_norm_ref(h, x, w_post, w_next, eps)
    return _gemma_norm_rows(h, x, w_post, w_next, eps)


def _gemma_norm_rows(h, x, w_post, w_next, eps: float):
    if x.dim() != 2 or (h is not None and h.shape != x.shape):
        raise ValueError(f"x and h must both be [T, E]; got {tuple(x.shape)} and "
                         f"{None if h is None else tuple(h.shape)}")
    if x.dtype not in _DTYPES or (h is not None and h.dtype != x.dtype):
        raise ValueError(f"x and h must share a float dtype; got {x.dtype} and {None if h is None else h.dtype}")
    if x.stride(-1) != 1 or (h is not None and h.stride(-1) != 1):
        raise ValueError("x and h must be contiguous in their last dimension")
    T, E = x.shape
    _check_gemma_weights(w_post, w_next, n=E)
    out = torch.empty(T, E, dtype=x.dtype, device=x.device)
    x_out = x if h is None else torch.empty(T, E, dtype=x.dtype, device=x.device)
    if T:
        _kernels()._gemma_norm_add_norm[(T,)](
            x if h is None else h, x, w_post, w_next, out, x_out, E, float(eps),
            0 if h is None else h.stride(0), x.stride(0), out.stride(0), x_out.stride(0),
            HAS_ADD=h is not None, BLOCK=max(16, next_pow2(E)), DT=_tl_dtype(x.dtype),
            num_warps=4 if E <= 2048 else 8, **_NO_FMA,
        )
    return out, x_out


def gemma_qk_norm_rope(q, k, cos, sin, q_norm_w, k_norm_w, eps: float, q_scale: float | None = None, v=None,
                       *, impl: str = "auto"):
    """Gemma's per-head q/k norms (weights [D]), RoPE, and q * q_scale (if given) on q [T, H, D]
    and k [T, Hkv, D], in one launch; with ``v`` [T, Hkv, D] also v copied contiguous, returned
    third (as ``rope_qk``). impl="torch": ``gemma_qk_norm_rope_ref`` (and v.contiguous())."""
    if resolve_impl(impl, q.device) == "torch":
        out = gemma_qk_norm_rope_ref(q, k, cos, sin, q_norm_w, k_norm_w, eps, q_scale)
        return out if v is None else (*out, v.contiguous())
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q [T, H, D] and k [T, Hkv, D] expected; got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (T, Hkv, D) or cos.shape != (T, 1, D) or sin.shape != cos.shape:
        raise ValueError(f"q [T, H, D], k [T, Hkv, D], cos/sin [T, 1, D] expected; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or (v is not None and v.dtype != q.dtype):
        raise ValueError(f"q, k and v must share a float dtype; got {q.dtype}, {k.dtype}, "
                         f"{None if v is None else v.dtype}")
    _check_gemma_weights(q_norm_w, k_norm_w, n=D)
    if k_norm_w.dtype != q_norm_w.dtype:
        raise ValueError(f"q_norm_w and k_norm_w must share a dtype; got {q_norm_w.dtype} and {k_norm_w.dtype}")
    return _launch_rope(q, k, cos, sin, v, (q_norm_w, k_norm_w, eps), q_scale)


def gelu_tanh_mul(gate, up, *, impl: str = "auto"):
    """gelu(gate, approximate="tanh") * up: [T, F] each, laid out as ``silu_mul`` takes them."""
    if resolve_impl(impl, gate.device) == "torch":
        return gelu_tanh_mul_ref(gate, up)
    return _gated("_gelu_tanh_mul", gate, up)
