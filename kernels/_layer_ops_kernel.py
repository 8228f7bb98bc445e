"""Triton bodies of the fused element-wise layer ops (launchers and contract: ``layer_ops.py``).

Each rounds to the activation dtype (DT) exactly where the torch expression it replaces
does, so only the RMSNorm's sum of squares may differ (its reduction order)."""

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


@triton.jit
def _rope_qk(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out, k_out, v_out,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
             stride_qot, stride_qoh, stride_kot, stride_koh, stride_vot, stride_voh,
             H, HKV, D: tl.constexpr, D_PAD: tl.constexpr, DT: tl.constexpr):
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
    else:
        src = k_ptr + t * stride_kt + (hh - H) * stride_kh
        dst = k_out + t * stride_kot + (hh - H) * stride_koh
    x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    xr = tl.load(src + rolled, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=m, other=0.0).to(tl.float32)
    a = _round_to(x * c, DT)  # x * cos, rounded as torch's product
    b = _round_to(xr * s, DT)  # x.roll(D/2) * sin
    tl.store(dst + d, (a + b).to(DT, fp_downcast_rounding="rtne"), mask=m)


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
