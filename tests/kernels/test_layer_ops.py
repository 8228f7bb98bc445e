"""Fused layer ops (under TRITON_INTERPRET=1 on the CPU) against their torch references,
which round to the activation dtype exactly where the model's torch code does."""

import pytest
import torch
import triton
import triton.language as tl

from spin_cluster.kernels.layer_ops import (
    add_rms_norm, add_rms_norm_ref, fits, rope_qk, rope_qk_ref, silu_mul, silu_mul_ref,
)
from spin_cluster.kernels import _layer_ops_kernel
from spin_cluster.models.layers import apply_rope

from .conftest import check_impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even (numpy
# has no bfloat16), so bfloat16 is checked on CUDA only; float16 rounds alike on both.
DTYPES = [torch.float32, torch.float16] + [
    pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")])]


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_equals_reference(dtype, with_residual):
    x, r = _rand(5, 96, dtype=dtype, seed=1), _rand(5, 96, dtype=dtype, seed=2)
    w = _rand(96, dtype=dtype, seed=3)
    res = r if with_residual else None
    got, got_res = add_rms_norm(x, res, w, 1e-5, impl="triton")
    want, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(got_res, want_res)  # the residual sum rounds exactly as torch's add
    # Only the sum of squares' order may differ: in a 16-bit dtype, rarely by one unit in the
    # last place; in float32 by a few.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_equals_the_models_rope(dtype):
    T, H, Hkv, D = 3, 4, 2, 16
    q, k = _rand(T, H, D, dtype=dtype, seed=4), _rand(T, Hkv, D, dtype=dtype, seed=5)
    cos, sin = _rand(T, 1, D, dtype=dtype, seed=6), _rand(T, 1, D, dtype=dtype, seed=7)
    gq, gk = rope_qk(q, k, cos, sin, impl="triton")
    _assert_rounds_as_torch(gq, apply_rope(q, cos, sin))
    _assert_rounds_as_torch(gk, apply_rope(k, cos, sin))
    rq, rk = rope_qk_ref(q, k, cos, sin)
    assert torch.equal(rq, apply_rope(q, cos, sin)) and torch.equal(rk, apply_rope(k, cos, sin))
    # Strided views, as the projections' outputs are viewed into heads.
    qkv = _rand(T, (H + 2 * Hkv) * D, dtype=dtype, seed=8)
    qv, kv = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    gq, gk = rope_qk(qv, kv, cos, sin, impl="triton")
    _assert_rounds_as_torch(gq, apply_rope(qv, cos, sin))
    _assert_rounds_as_torch(gk, apply_rope(kv, cos, sin))
    # With v (a fused GEMM's third view): the same q, k, and v copied out contiguous.
    vv = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    gq2, gk2, gv = rope_qk(qv, kv, cos, sin, vv, impl="triton")
    assert torch.equal(gq2, gq) and torch.equal(gk2, gk)
    assert gv.is_contiguous() and torch.equal(gv, vv)


def _assert_rounds_as_torch(got, want):
    """float32 and float16: bit for bit. bfloat16 on the H200: a few elements one unit in the
    last place apart (at least 3 of the 48 of q on the H200), where the sum of the two rounded products lands
    on a tie; never more than one unit."""
    if got.dtype != torch.bfloat16:
        assert torch.equal(got, want)
        return
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got != want).float().mean() <= 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_reference(dtype):
    g, u = _rand(3, 2500, dtype=dtype, seed=9), _rand(3, 2500, dtype=dtype, seed=10)
    got, want = silu_mul(g, u, impl="triton"), silu_mul_ref(g, u)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # silu's exp may differ by an ulp in float32 before the 16-bit rounding
        assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_silu_mul_reads_the_halves_of_a_fused_gate_up_row():
    gu = _rand(5, 2 * 1300, dtype=torch.float32, seed=11)  # [T, 2F]: gate, then up
    gate, up = gu[:, :1300], gu[:, 1300:]
    torch.testing.assert_close(silu_mul(gate, up, impl="triton"), silu_mul_ref(gate, up), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="row stride"):
        silu_mul(gate, up.contiguous(), impl="triton")


def test_kernels_serve_cuda_tensors_of_one_dtype_only():
    x = torch.zeros(2, 8)
    assert not fits(x)  # the model runs the references off CUDA
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.zeros(4), 1e-5, impl="triton")



@triton.jit
def _round_bf16_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N)
    tl.store(out_ptr + i, _layer_ops_kernel._round_to(x, tl.bfloat16), mask=i < N)


def test_bf16_rounding_on_the_bits_is_torchs_round_to_nearest_even():
    """The kernels' bfloat16 rounding of a float32 (``_round_to``), on random values and on
    exact ties between two bfloat16 values, both signs: torch's conversion, bit for bit."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(512, generator=g) * 8).to(torch.bfloat16).float()  # exact bf16 values
    half_ulp = (base.view(torch.int32) & 0x7F800000).view(torch.float32) * 2.0**-8
    ties = base + half_ulp * base.sign()  # halfway to the next bf16 away from zero
    x = torch.cat([torch.randn(512, generator=g) * 100, ties, -ties]).to(DEVICE)
    out = torch.empty_like(x)
    _round_bf16_kernel[(1,)](x, out, x.numel(), BLOCK=2048)
    assert torch.equal(out, x.to(torch.bfloat16).float())
    tied = out[512:1024].cpu()
    assert (tied == base).any() and (tied != base).any()  # ties went both ways: to the even one


def test_impl_choice():
    x, r, w = _rand(3, 40, dtype=torch.float32, seed=12), _rand(3, 40, dtype=torch.float32, seed=13), \
        _rand(40, dtype=torch.float32, seed=14)
    check_impls(add_rms_norm, add_rms_norm_ref, lambda: ([x, r, w, 1e-5], {}), exact=False)
    q, k = _rand(2, 4, 8, dtype=torch.float32, seed=15), _rand(2, 2, 8, dtype=torch.float32, seed=16)
    cos, sin = _rand(2, 1, 8, dtype=torch.float32, seed=17), _rand(2, 1, 8, dtype=torch.float32, seed=18)
    check_impls(rope_qk, rope_qk_ref, lambda: ([q, k, cos, sin], {}))
    check_impls(silu_mul, silu_mul_ref, lambda: ([x, r], {}), exact=False)
