"""Triton bodies of the fused element-wise layer ops (launchers and contract: ``layer_ops.py``).

Each rounds to the activation dtype (DT) exactly where the torch expression it replaces
does, so only the RMSNorm's sum of squares (its reduction order) and the exp of the
activations may differ."""

import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, E, eps,
                  stride_x, stride_res, stride_out, stride_res_out,
                  HAS_RES: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < E
    s = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:  # s = x + residual, in DT, and kept as the next residual
        r = tl.load(res_ptr + row * stride_res + offs, mask=m, other=0.0).to(tl.float32)
        s_dt = (s + r).to(DT, fp_downcast_rounding="rtne")
        tl.store(res_out_ptr + row * stride_res_out + offs, s_dt, mask=m)
        s = s_dt.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / E + eps)
    normed = (s * rstd).to(DT, fp_downcast_rounding="rtne").to(tl.float32)  # rms_norm in float32, then .to(x.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(DT, fp_downcast_rounding="rtne"), mask=m)


@triton.jit
def _round_to(x, DT: tl.constexpr):
    """float32 x rounded to the nearest DT value (ties to even), as float32. For bfloat16 the
    rounding is done on the bits: on the H200 the compiled round trip float32 -> bf16 ->
    float32 of a product did not always round (RoPE came out up to 2 units in the last place
    off torch's), as if the round trip were folded away."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit(do_not_specialize=["N"])  # the step's rows: one compile for every step
def _silu_mul(g_ptr, u_ptr, out_ptr, N, F, stride_in, BLOCK: tl.constexpr, DT: tl.constexpr):
    """out[t, f] = silu(gate[t, f]) * up[t, f] for N = T * F outputs; gate and up rows are
    ``stride_in`` apart (F when separate, 2F when both are halves of one fused GEMM's row)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    src = (offs // F) * stride_in + offs % F
    g = tl.load(g_ptr + src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + src, mask=m, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT, fp_downcast_rounding="rtne").to(tl.float32)  # silu(gate) in DT
    tl.store(out_ptr + offs, (act * u).to(DT, fp_downcast_rounding="rtne"), mask=m)


# ---- Gemma 3 ------------------------------------------------------------------------------------
# Every value stored is rounded by ``_round_to`` first, so the store's own conversion to DT is
# exact: bfloat16 then rounds as torch's under the interpreter too, which would truncate.

@triton.jit
def _rstd(y, N, eps):
    """rsqrt(mean(y^2) + eps) of one row y (float32, zeros past its N elements)."""
    return tl.math.rsqrt(tl.sum(y * y, axis=0) / N + eps)


@triton.jit
def _gemma_scale(y, rstd, w_ptr, offs, m, DT: tl.constexpr):
    """GemmaRMSNorm's y * rstd * (1 + w) with the weight at ``w_ptr + offs``: float32 in
    torch's order, rounded to DT once (returned as float32)."""
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return _round_to(y * rstd * (1.0 + w), DT)


@triton.jit
def _gemma_norm_add_norm(h_ptr, x_ptr, w_post_ptr, w_next_ptr, out_ptr, x_out_ptr, E, eps,
                         stride_h, stride_x, stride_out, stride_x_out,
                         HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    """One row: x_new = x + norm(h, w_post) (with HAS_ADD; else x_new = x), out = norm(x_new, w_next)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < E
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:  # the post-norm in DT, then the residual add rounded to DT: torch's x + norm(h)
        h = tl.load(h_ptr + row * stride_h + offs, mask=m, other=0.0).to(tl.float32)
        x = _round_to(x + _gemma_scale(h, _rstd(h, E, eps), w_post_ptr, offs, m, DT), DT)
        tl.store(x_out_ptr + row * stride_x_out + offs, x.to(DT), mask=m)
    out = _gemma_scale(x, _rstd(x, E, eps), w_next_ptr, offs, m, DT)
    tl.store(out_ptr + row * stride_out + offs, out.to(DT), mask=m)


@triton.jit
def _rope_qk(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, q_out, k_out, v_out,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
             stride_qot, stride_qoh, stride_kot, stride_koh, stride_vot, stride_voh,
             H, HKV, eps, q_scale,
             HAS_NORM: tl.constexpr, HAS_SCALE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
             DT: tl.constexpr):
    """One (token, head) row of D: with HAS_NORM the head's GemmaRMSNorm first (weights at
    wq_ptr / wk_ptr), then RoPE, then (query heads, HAS_SCALE) q * q_scale rounded to DT; the
    heads past H + HKV copy v."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)  # query heads, then KV heads, then (if given) v's heads: copied as is
    d = tl.arange(0, D_PAD)
    m = d < D
    if hh >= H + HKV:
        x = tl.load(v_ptr + t * stride_vt + (hh - H - HKV) * stride_vh + d, mask=m, other=0.0)
        tl.store(v_out + t * stride_vot + (hh - H - HKV) * stride_voh + d, x, mask=m)
        return
    rolled = (d + D // 2) % D  # x.roll(D/2)[d] = x[(d - D/2) mod D] = x[(d + D/2) mod D]
    if hh < H:
        src = q_ptr + t * stride_qt + hh * stride_qh
        dst = q_out + t * stride_qot + hh * stride_qoh
        w_ptr = wq_ptr
    else:
        src = k_ptr + t * stride_kt + (hh - H) * stride_kh
        dst = k_out + t * stride_kot + (hh - H) * stride_koh
        w_ptr = wk_ptr
    x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = _rstd(x, D, eps)
        x = _gemma_scale(x, rstd, w_ptr, d, m, DT)  # the normed row, as torch's q_norm(q) holds it
        xr = _gemma_scale(xr, rstd, w_ptr, rolled, m, DT)  # its roll: each element with its own weight
    c = tl.load(cos_ptr + t * stride_ct + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=m, other=0.0).to(tl.float32)
    # x * cos + x.roll(D/2) * sin, each product rounded as torch's
    y = _round_to(_round_to(x * c, DT) + _round_to(xr * s, DT), DT)
    if HAS_SCALE:  # torch's bf16 q * python_float: float32 product, rounded once; k heads times 1, exact
        y = _round_to(y * tl.where(hh < H, q_scale, 1.0), DT)
    tl.store(dst + d, y.to(DT), mask=m)


# gelu's tanh approximation, with torch's constants (float32 in the kernel, as torch's opmath).
_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit(do_not_specialize=["N"])  # the step's rows: one compile for every step
def _gelu_tanh_mul(g_ptr, u_ptr, out_ptr, N, F, stride_in, BLOCK: tl.constexpr, DT: tl.constexpr):
    """out[t, f] = gelu_tanh(gate[t, f]) * up[t, f], addressed as ``_silu_mul``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    src = (offs // F) * stride_in + offs % F
    g = tl.load(g_ptr + src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + src, mask=m, other=0.0).to(tl.float32)
    inner = _GELU_BETA * (g + _GELU_KAPPA * (g * g * g))
    # tanh(u) = 2 / (1 + e^-2u) - 1, from exp: the interpreter has no tanh. This form
    # saturates without nan (to 1 as e^-2u underflows to 0, to -1 as it overflows to inf), and
    # its 2 / (1 + e^-2u) is accurate relative to itself even as tanh nears -1, so the
    # subtraction rounds tanh to float32 as torch's tanh is rounded and 1 + tanh below keeps
    # torch's value for very negative gates; 1 - 2 / (e^2u + 1) lands on a grid twice as
    # coarse there and differs from torch in ten times as many bfloat16 outputs.
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
    act = _round_to(0.5 * g * (1.0 + tanh), DT)  # gelu(gate) in DT
    tl.store(out_ptr + offs, _round_to(act * u, DT).to(DT), mask=m)
