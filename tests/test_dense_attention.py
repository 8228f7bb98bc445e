"""The dense prefill backend: the rule, the probe's fallbacks, the cuDNN chunk merge, and
(on a GPU) the engine's prefill attention on the chosen kernel against flash."""

import pytest
import torch

from spin_cluster import dense_attention
from spin_cluster.dense_attention import (
    DenseBackend,
    Kernel,
    backend_rule,
    choose_backend,
    dense_causal_attention,
    reference_attention,
)
from spin_cluster.dense_attention import prefill_attention
from spin_cluster.kernels import cpu_native

_real_native = cpu_native.prefill_attention_cpu

BF16, F32 = torch.bfloat16, torch.float32
HOPPER, AMPERE = (9, 0), (8, 0)


@pytest.mark.parametrize("device_type, capability, dtype, head_dim, cudnn, want", [
    ("cpu", None, BF16, 128, False, "default"),
    ("cpu", None, F32, 64, False, "native"),
    ("cuda", HOPPER, BF16, 128, True, "cudnn"),
    ("cuda", HOPPER, torch.float16, 64, True, "cudnn"),
    ("cuda", (10, 0), BF16, 128, True, "cudnn"),
    ("cuda", AMPERE, BF16, 128, True, "flash"),
    ("cuda", HOPPER, BF16, 256, True, "flash"),
    ("cuda", HOPPER, BF16, 128, False, "flash"),
    ("cuda", HOPPER, F32, 128, True, "default"),
])
def test_rule_picks_cudnn_on_hopper_in_half_precision(device_type, capability, dtype, head_dim, cudnn, want):
    assert backend_rule(device_type, capability, dtype, head_dim, cudnn, native_available=True) == want
    if want == "native":  # where the CPU kernel did not build
        assert backend_rule(device_type, capability, dtype, head_dim, cudnn, native_available=False) == "default"


def test_choose_backend_asks_the_probe_only_for_cudnn_and_falls_back_to_flash():
    calls = []

    def failing(*args):
        calls.append(args)
        return None

    dev = torch.device("cuda", 0)
    got = choose_backend(dev, BF16, 32, 8, 128, capability=HOPPER, cudnn_available=True, probe=failing)
    assert got == DenseBackend.of("flash") and len(calls) == 1
    passing = lambda *a: DenseBackend(Kernel("cudnn", True), Kernel("flash"))  # noqa: E731
    got = choose_backend(dev, BF16, 32, 8, 128, capability=HOPPER, cudnn_available=True, probe=passing)
    assert got.name == "cudnn/flash" and got.for_chunk(0).expand_kv and got.for_chunk(7).name == "flash"
    both = DenseBackend.of("cudnn")
    assert both.for_chunk(7, 2048).name == "cudnn" and both.for_chunk(7, 1).name == "flash"  # a decode row
    got = choose_backend(dev, BF16, 32, 8, 128, capability=AMPERE, cudnn_available=True, probe=failing)
    assert got == DenseBackend.of("flash") and len(calls) == 1
    cpu = "native" if cpu_native.available() else "default"
    assert choose_backend(torch.device("cpu"), F32, 4, 2, 16) == DenseBackend.of(cpu)
    assert choose_backend(torch.device("cpu"), BF16, 4, 2, 16) == DenseBackend.of("default")


def _qkv(n, cs, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=g), torch.randn(Hkv, cs + n, D, generator=g),
            torch.randn(Hkv, cs + n, D, generator=g))


def _explicit(q, k, v, causal):
    """[1, H, n, D] against [1, H, T, D]: (output, natural-log log-sum-exp [1, H, n])."""
    s = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype), s.logsumexp(-1)


@pytest.mark.parametrize("cs", [0, 5, 40])
def test_the_cpu_path_is_the_lower_right_causal_reference(cs):
    q, k, v = _qkv(9, cs)
    want = reference_attention(q, k, v, cs)
    assert torch.allclose(prefill_attention(q, k, v, cs), want, atol=1e-5)
    assert torch.allclose(dense_causal_attention(q, k, v, cs, DenseBackend.of("default")), want, atol=1e-6)
    if cpu_native.available():
        assert torch.allclose(dense_causal_attention(q, k, v, cs, DenseBackend.of("native")), want, atol=1e-5)


@pytest.mark.parametrize("cs", [0, 700])
def test_the_cpu_sliding_window_takes_the_native_kernel_and_matches_the_blocked_sdpa(cs, monkeypatch):
    from spin_cluster.dense_attention import sliding_window_attention

    n, window = 300, 128
    key_start = max(0, cs - window + 1) // 16 * 16  # the engine's first page of the window
    g = torch.Generator().manual_seed(cs)
    q = torch.randn(n, 4, 32, generator=g)
    k, v = (torch.randn(1, cs + n - key_start, 32, generator=g) for _ in range(2))
    calls = []
    monkeypatch.setattr(cpu_native, "prefill_attention_cpu",
                        lambda *a, **kw: calls.append(a) or _real_native(*a, **kw))
    got = prefill_attention(q, k, v, cs, window=window, key_start=key_start)
    want = sliding_window_attention(q, k, v, cs, window, key_start)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert len(calls) == (1 if cpu_native.available() else 0)


def test_cudnn_chunk_merges_context_and_causal_square_by_log_sum_exp(monkeypatch):
    """A later chunk on cuDNN is two attentions merged by their log-sum-exp: checked here
    with an explicit softmax standing in for cuDNN's kernel, native GQA refused."""
    def fake_lse(q, k, v, causal):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("No available kernel")
        return _explicit(q, k, v, causal)

    monkeypatch.setattr(dense_attention, "_cudnn_lse", fake_lse)
    q, k, v = _qkv(70, 29)
    want = reference_attention(q, k, v, 29)
    expanded = Kernel("cudnn", True)
    got = dense_causal_attention(q, k, v, 29, DenseBackend(expanded, expanded))
    assert torch.allclose(got, want, atol=1e-5)
    # Native GQA refused at run time: the chunk runs on the fallback (here SDPA's own CPU kernel).
    monkeypatch.setitem(dense_attention._SDP, "flash", torch.nn.attention.SDPBackend.MATH)
    got = dense_causal_attention(q, k, v, 29, DenseBackend.of("cudnn"))
    assert torch.allclose(got, want, atol=1e-5)


def test_probe_keeps_the_first_form_that_matches(monkeypatch):
    """Native GQA fails, expanded heads pass: the probe picks expanded for both forms; a chunk
    form that is wrong stays on flash."""
    def fake_chunk(q, k, v, context_start):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("No available kernel")
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(context_start, k.shape[2])[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o if context_start == 0 else o + 1  # a broken chunk form

    monkeypatch.setattr(dense_attention, "_cudnn_chunk", fake_chunk)
    got = dense_attention.probe_cudnn(torch.device("cpu"), F32, 4, 2, 16)
    assert got == DenseBackend(Kernel("cudnn", True), Kernel("flash"))
    monkeypatch.setattr(dense_attention, "_cudnn_chunk", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    assert dense_attention.probe_cudnn(torch.device("cpu"), F32, 4, 2, 16) is None


# ---- GPU: the engine's prefill attention on the chosen kernel ----------------------------------


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.gpu
@pytest.mark.parametrize("cs", [0, 30 * 1024])
def test_engine_prefill_runs_on_the_chosen_backend_and_matches_flash(cs):
    """Llama-3.1-8B attention shapes (H=32, Hkv=8, D=128, bf16) at 32K context: a whole
    prompt, and a 2K chunk after 30K tokens (chunked prefill's lower-right mask)."""
    dev = torch.device("cuda")
    n = 32 * 1024 - cs
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, 32, 128, device=dev, dtype=BF16, generator=g)
    k = torch.randn(8, cs + n, 128, device=dev, dtype=BF16, generator=g)
    v = torch.randn(8, cs + n, 128, device=dev, dtype=BF16, generator=g)
    chosen = dense_attention.device_backend(dev, BF16, 32, 8, 128)
    print(f"dense prefill backend on {torch.cuda.get_device_name()}: {chosen}")
    if torch.cuda.get_device_capability() >= HOPPER:
        assert chosen.for_chunk(cs).name == "cudnn", chosen
    got = prefill_attention(q, k, v, cs)  # the engine's dense prefill
    flash = dense_causal_attention(q, k, v, cs, DenseBackend.of("flash"))
    # Both round the same fp32 result to bf16: allow an ulp or two at the output's magnitude.
    err = ((got.float() - flash.float()).abs() - 2e-2 * flash.float().abs()).max().item()
    assert err < 2e-2, err
    names = _kernel_names(lambda: prefill_attention(q, k, v, cs))
    on_flash = any("flash_fwd" in x for x in names)
    if chosen.for_chunk(cs).name == "cudnn":
        assert not on_flash and any(w in x.lower() for x in names for w in ("cudnn", "sdpa", "fprop")), names[:20]
    else:
        assert on_flash, names[:20]


def test_the_environment_overrides_the_rule(monkeypatch):
    dev = torch.device("cuda", 0)
    failing = lambda *a: None  # noqa: E731
    got = choose_backend(dev, BF16, 32, 8, 128, capability=HOPPER, cudnn_available=True, probe=failing,
                         override="flash")
    assert got == DenseBackend.of("flash")
    with pytest.raises(ValueError, match="SPIN_DENSE_PREFILL=cudnn"):
        choose_backend(dev, BF16, 32, 8, 128, capability=AMPERE, cudnn_available=True, probe=failing,
                       override="cudnn")
    monkeypatch.setenv("SPIN_DENSE_PREFILL", "math")
    with pytest.raises(ValueError, match="choose one of"):
        dense_attention.device_backend(torch.device("cpu"), F32, 4, 2, 16)
    monkeypatch.setenv("SPIN_DENSE_PREFILL", "default")
    assert dense_attention.device_backend(torch.device("cpu"), F32, 4, 2, 16) == DenseBackend.of("default")
    monkeypatch.setenv("SPIN_DENSE_PREFILL", "native")
    with pytest.raises(ValueError, match="SPIN_DENSE_PREFILL=native"):
        dense_attention.device_backend(torch.device("cpu"), BF16, 4, 2, 16)
