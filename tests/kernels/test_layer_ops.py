"""Fused layer ops (under TRITON_INTERPRET=1 on the CPU) against their torch references,
which round to the activation dtype exactly where the model's torch code does."""

import pytest
import torch
import triton
import triton.language as tl

from spin_cluster.kernels.layer_ops import (
    add_rms_norm, add_rms_norm_ref, fits, gelu_tanh_mul, gelu_tanh_mul_ref, gemma_norm_add_norm,
    gemma_norm_add_norm_ref, gemma_qk_norm_rope, gemma_qk_norm_rope_ref, gemma_rms_norm, gemma_rms_norm_ref,
    rope_qk, rope_qk_ref, silu_mul, silu_mul_ref,
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


# ---- Gemma 3 ------------------------------------------------------------------------------------
# The Gemma kernels round every value they store on the bits (``_round_to``), so bfloat16
# rounds as torch's under the interpreter too.
GEMMA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _exact_squares(*shape, dtype, seed):
    """Multiples of 1/8 in [-2, 2]: their squares are multiples of 1/64, and a sum of up to
    2^12 of them is exact in float32 in any order. A row of these has one mean square
    whatever the reduction order, so a kernel's norm of it must equal torch's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g) / 8).to(dtype=dtype, device=DEVICE)


def _norm_weight(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(n, generator=g)).to(dtype=dtype, device=DEVICE)  # Gemma scales by 1 + w


def _assert_norm_close(got, want):
    """The tolerance of ``test_add_rms_norm_equals_reference``: only the sum of squares' order differs."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert (got != want).float().mean() < 0.05


def test_gemma_references_equal_transformers():
    """The references against transformers' own Gemma 3 modules, bit for bit (bfloat16): the
    norm, a post-norm's residual add and the next norm, the norms with RoPE (transformers'
    rotate_half with unsigned sin), and the GELU-tanh gate."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

    dt = torch.bfloat16

    def hf_norm(n, seed):
        norm = Gemma3RMSNorm(n, eps=EPS).to(dt)
        norm.weight.data.copy_(_norm_weight(n, dt, seed).cpu())
        return norm

    h, x = _rand(5, 64, dtype=dt, seed=40).cpu(), _rand(5, 64, dtype=dt, seed=41).cpu()
    post, nxt = hf_norm(64, 42), hf_norm(64, 43)
    with torch.no_grad():
        assert torch.equal(gemma_rms_norm_ref(x, post.weight, EPS), post(x))
        want_x = x + post(h)
        got = gemma_norm_add_norm_ref(h, x, post.weight, nxt.weight, EPS)
        assert torch.equal(got[1], want_x) and torch.equal(got[0], nxt(want_x))
        T, H, Hkv, D = 3, 4, 2, 32
        q, k = _rand(T, H, D, dtype=dt, seed=44).cpu(), _rand(T, Hkv, D, dtype=dt, seed=45).cpu()
        angles = torch.rand(T, D // 2, generator=torch.Generator().manual_seed(46)) * 6
        cos, sin = torch.cat([angles, angles], -1).cos().to(dt), torch.cat([angles, angles], -1).sin().to(dt)
        signed_sin = torch.cat([-sin[:, : D // 2], sin[:, D // 2 :]], -1)
        qn, kn = hf_norm(D, 47), hf_norm(D, 48)
        want_q, want_k = apply_rotary_pos_emb(qn(q), kn(k), cos, sin, unsqueeze_dim=1)
        args = (q, k, cos[:, None], signed_sin[:, None], qn.weight, kn.weight, EPS)
        got_q, got_k = gemma_qk_norm_rope_ref(*args)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        got_q, _ = gemma_qk_norm_rope_ref(*args, 0.5 ** 0.5)
        assert torch.equal(got_q, want_q * 0.5 ** 0.5)
    g, u = _rand(3, 100, dtype=dt, seed=49).cpu(), _rand(3, 100, dtype=dt, seed=50).cpu()
    assert torch.equal(gelu_tanh_mul_ref(g, u), ACT2FN["gelu_pytorch_tanh"](g) * u)


@pytest.mark.parametrize("dtype", GEMMA_DTYPES)
@pytest.mark.parametrize("w_dtype", ["activations", torch.float32])
def test_gemma_rms_norm_equals_reference(dtype, w_dtype):
    w = _norm_weight(64, dtype if w_dtype == "activations" else w_dtype, seed=20)
    wide = _rand(5, 96, dtype=dtype, seed=21)
    x = wide[:, 16:80]  # rows 96 apart
    _assert_norm_close(gemma_rms_norm(x, w, EPS, impl="triton"), gemma_rms_norm_ref(x, w, EPS))
    x = _exact_squares(5, 64, dtype=dtype, seed=22)
    assert torch.equal(gemma_rms_norm(x, w, EPS, impl="triton"), gemma_rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", GEMMA_DTYPES)
@pytest.mark.parametrize("w_dtype", ["activations", torch.float32])
def test_gemma_norm_add_norm_equals_reference(dtype, w_dtype):
    wdt = dtype if w_dtype == "activations" else w_dtype
    w_post, w_next = _norm_weight(64, wdt, seed=23), _norm_weight(64, wdt, seed=24)
    # h and x as row views of wider tensors (an o_proj output is contiguous, but any row stride goes)
    h, x = _rand(5, 80, dtype=dtype, seed=25)[:, :64], _rand(5, 72, dtype=dtype, seed=26)[:, 8:]
    got, got_x = gemma_norm_add_norm(h, x, w_post, w_next, EPS, impl="triton")
    want, want_x = gemma_norm_add_norm_ref(h, x, w_post, w_next, EPS)
    assert got.is_contiguous() and got_x.is_contiguous()
    _assert_norm_close(got_x, want_x)
    _assert_norm_close(got, want)
    # The elementwise parts exactly. A post-norm of exactly summed squares: the residual sum is
    # torch's bit for bit (the norm rounded to DT, then the add) ...
    h = _exact_squares(5, 64, dtype=dtype, seed=27)
    got, got_x = gemma_norm_add_norm(h, x, w_post, w_next, EPS, impl="triton")
    want, want_x = gemma_norm_add_norm_ref(h, x, w_post, w_next, EPS)
    assert torch.equal(got_x, want_x)
    _assert_norm_close(got, want)
    # ... and a post-norm weight of -1 (scale 1 + w = 0) leaves x as it is, so the next norm of
    # an exactly summed x is torch's bit for bit.
    x = _exact_squares(5, 64, dtype=dtype, seed=28)
    got, got_x = gemma_norm_add_norm(h, x, torch.full_like(w_post, -1.0), w_next, EPS, impl="triton")
    want, want_x = gemma_norm_add_norm_ref(h, x, torch.full_like(w_post, -1.0), w_next, EPS)
    assert torch.equal(got_x, x) and torch.equal(want_x, x) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", GEMMA_DTYPES)
@pytest.mark.parametrize("D, Hkv", [(256, 1), (256, 2), (128, 1), (128, 4)])
@pytest.mark.parametrize("q_scale", [None, (256 / 168) ** 0.5])
def test_gemma_qk_norm_rope_equals_reference(dtype, D, Hkv, q_scale):
    """q, k and v as views of one fused q/k/v GEMM output; H = 4 query heads. Rows of exactly
    summed squares: bit for bit, the roll reading the rolled element's weight and the scale
    included; random rows: within the norms' tolerance."""
    T, H = 3, 4
    w_q, w_k = _norm_weight(D, dtype, seed=30), _norm_weight(D, dtype, seed=31)
    cos, sin = _rand(T, 1, D, dtype=dtype, seed=32), _rand(T, 1, D, dtype=dtype, seed=33)

    def views(qkv):  # [T, (H + 2 Hkv) D] -> q [T, H, D], k, v [T, Hkv, D], rows strided
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)

    q, k, v = views(_exact_squares(T, (H + 2 * Hkv) * D, dtype=dtype, seed=34))
    got = gemma_qk_norm_rope(q, k, cos, sin, w_q, w_k, EPS, q_scale, impl="triton")
    want = gemma_qk_norm_rope_ref(q, k, cos, sin, w_q, w_k, EPS, q_scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gq, gk, gv = gemma_qk_norm_rope(q, k, cos, sin, w_q, w_k, EPS, q_scale, v=v, impl="triton")
    assert torch.equal(gq, got[0]) and torch.equal(gk, got[1])
    assert gv.is_contiguous() and torch.equal(gv, v)

    q, k, _ = views(_rand(T, (H + 2 * Hkv) * D, dtype=dtype, seed=35))
    got = gemma_qk_norm_rope(q, k, cos, sin, w_q, w_k, EPS, q_scale, impl="triton")
    want = gemma_qk_norm_rope_ref(q, k, cos, sin, w_q, w_k, EPS, q_scale)
    _assert_norm_close(got[0], want[0])
    _assert_norm_close(got[1], want[1])


def test_gemma_qk_norm_rope_takes_float32_weights():
    T, H, Hkv, D = 2, 4, 2, 32
    q = _exact_squares(T, H, D, dtype=torch.float16, seed=36)
    k = _exact_squares(T, Hkv, D, dtype=torch.float16, seed=37)
    cos, sin = _rand(T, 1, D, dtype=torch.float16, seed=38), _rand(T, 1, D, dtype=torch.float16, seed=39)
    w_q, w_k = _norm_weight(D, torch.float32, seed=40), _norm_weight(D, torch.float32, seed=41)
    got = gemma_qk_norm_rope(q, k, cos, sin, w_q, w_k, EPS, 0.9, impl="triton")
    want = gemma_qk_norm_rope_ref(q, k, cos, sin, w_q, w_k, EPS, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-2u) for very negative gates: inf, as meant
@pytest.mark.parametrize("dtype", GEMMA_DTYPES)
def test_gelu_tanh_mul_equals_reference(dtype):
    g, u = _rand(3, 2500, dtype=dtype, seed=51) * 3, _rand(3, 2500, dtype=dtype, seed=52)
    got, want = gelu_tanh_mul(g, u, impl="triton"), gelu_tanh_mul_ref(g, u)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # tanh from exp may differ by an ulp in float32 before the 16-bit rounding
        assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    # Saturation: gates far out on either side give gate and zero, never nan.
    far = torch.tensor([[-1e4, -60.0, 60.0, 1e4]], dtype=dtype, device=DEVICE)
    one = torch.ones_like(far)
    assert torch.equal(gelu_tanh_mul(far, one, impl="triton"), gelu_tanh_mul_ref(far, one))


def test_gelu_tanh_mul_reads_the_halves_of_a_fused_gate_up_row():
    gu = _rand(5, 2 * 1300, dtype=torch.float32, seed=53)  # [T, 2F]: gate, then up
    gate, up = gu[:, :1300], gu[:, 1300:]
    got, want = gelu_tanh_mul(gate, up, impl="triton"), gelu_tanh_mul_ref(gate, up)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="row stride"):
        gelu_tanh_mul(gate, up.contiguous(), impl="triton")


def test_gemma_launchers_refuse_what_their_kernels_cannot_read():
    x, w = torch.zeros(2, 8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"norm weights must be contiguous \[8\]"):
        gemma_rms_norm(x, torch.zeros(4), EPS, impl="triton")
    with pytest.raises(ValueError, match="x and h must both be"):
        gemma_norm_add_norm(torch.zeros(3, 8), x, w, w, EPS, impl="triton")
    with pytest.raises(ValueError, match="share a float dtype"):
        gemma_norm_add_norm(x.half(), x, w, w, EPS, impl="triton")
    with pytest.raises(ValueError, match="last dimension"):
        gemma_rms_norm(torch.zeros(8, 2).t(), w, EPS, impl="triton")
    q, k, cs = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match=r"cos/sin \[T, 1, D\]"):
        gemma_qk_norm_rope(q, k, torch.zeros(3, 1, 8), cs, w, w, EPS, impl="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        gemma_qk_norm_rope(q, k, cs, cs, w, w.half(), EPS, impl="triton")


def test_gemma_impl_choice():
    x, h = _rand(3, 32, dtype=torch.float32, seed=54), _rand(3, 32, dtype=torch.float32, seed=55)
    w, w2 = _norm_weight(32, torch.float32, seed=56), _norm_weight(32, torch.float32, seed=57)
    check_impls(gemma_rms_norm, gemma_rms_norm_ref, lambda: ([x, w, EPS], {}), exact=False)
    check_impls(gemma_norm_add_norm, gemma_norm_add_norm_ref, lambda: ([h, x, w, w2, EPS], {}), exact=False)
    q, k = _rand(2, 4, 8, dtype=torch.float32, seed=58), _rand(2, 2, 8, dtype=torch.float32, seed=59)
    cos, sin = _rand(2, 1, 8, dtype=torch.float32, seed=60), _rand(2, 1, 8, dtype=torch.float32, seed=61)
    wq, wk = _norm_weight(8, torch.float32, seed=62), _norm_weight(8, torch.float32, seed=63)
    check_impls(gemma_qk_norm_rope, gemma_qk_norm_rope_ref, lambda: ([q, k, cos, sin, wq, wk, EPS, 1.5], {}),
                exact=False)
    check_impls(gelu_tanh_mul, gelu_tanh_mul_ref, lambda: ([x, h], {}), exact=False)


class _OneSequenceAttention:
    """LayerAttention for one sequence whose tokens all come in one step, with the layer's window."""

    def forward(self, layer_id, q, k, v, window=None):
        from spin_cluster.dense_attention import sliding_window_attention

        return sliding_window_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, window or q.shape[0])


def _tiny_gemma3(dtype):
    """Three layers (the second full attention, the others a window of 4), D = 32 with
    query_pre_attn_scalar 24 (q scaled), fused q/k/v and gate/up GEMMs."""
    from transformers import Gemma3TextConfig

    from spin_cluster.models import ModelConfig
    from spin_cluster.models.gemma3 import Gemma3CausalLM

    hf = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = ModelConfig.from_json_dict({**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    torch.manual_seed(0)
    model = Gemma3CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))  # Gemma scales by 1 + weight
    return model.to(dtype=dtype, device=DEVICE).eval().fuse_projections()


def _counted(launcher, name, calls):
    def run(*args, **kwargs):
        calls.append(name)
        return launcher(*args, **kwargs)

    return run


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_forward_with_the_kernels_equals_the_torch_layers(dtype, monkeypatch):
    """A tiny Gemma 3 with every fused op forced to its kernel (the interpreter's on the CPU)
    against the same model on the references; and on the references, the model against the
    layer loop as written before the fusion (``x + post_norm(sublayer(norm(x)))``, the final
    norm last), bit for bit."""
    from spin_cluster.kernels import layer_ops

    model = _tiny_gemma3(dtype)
    ids, positions = torch.randint(3, 96, (9,), device=DEVICE), torch.arange(9, device=DEVICE)
    with torch.no_grad():
        monkeypatch.setattr(layer_ops, "fits", lambda x, weight=None: False)  # the references, on any device
        x = model.embed_tokens(ids) * torch.tensor(model.embed_scale, dtype=dtype)
        full, local = model.rotary(positions, dtype), model.local_rotary(positions, dtype)
        for layer in model.layers:
            cos, sin = full if layer.self_attn.window is None else local
            a = layer.self_attn(layer.input_layernorm(x), cos, sin, _OneSequenceAttention())
            x = x + layer.post_attention_layernorm(a)
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        unfused = model.norm(x)
        assert torch.equal(model(ids, positions, _OneSequenceAttention()), unfused)

        calls = []
        for name in ("gemma_rms_norm", "gemma_norm_add_norm", "gemma_qk_norm_rope", "gelu_tanh_mul"):
            monkeypatch.setattr(layer_ops, name, _counted(getattr(layer_ops, name), name, calls))
        monkeypatch.setattr(layer_ops, "fits", lambda x, weight=None: True)
        monkeypatch.setattr(layer_ops, "resolve_impl", lambda impl, device: "triton")
        fused = model(ids, positions, _OneSequenceAttention())
    assert sorted(calls) == sorted(["gemma_rms_norm"] + ["gemma_norm_add_norm"] * 6 + ["gemma_qk_norm_rope"] * 3
                                   + ["gelu_tanh_mul"] * 3)
    # Seen: under the interpreter float32 within 1e-6 and bfloat16 bit for bit; on an H100
    # bfloat16 within one unit in the last place (a norm's ulp, carried through three layers).
    if dtype == torch.float32:
        torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(fused, unfused, atol=0.05, rtol=0.02)
