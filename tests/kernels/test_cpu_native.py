"""The CPU decode attention kernel that reads pages in place, against the torch reference.

It builds with the machine's C compiler on first use; without one the engine keeps the
gather path, and these tests check that fallback instead of skipping.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from spin_cluster.kernels import cpu_native
from spin_cluster.kernels.paged_decode import paged_decode_attention_ref

HAS_CC = shutil.which("cc") is not None


def _case(B, Hkv, G, D, S, lens, layers=3, seed=0):
    """Random pages in a shuffled pool, [B, layers, Hkv, P] int32 tables (the engine's layout:
    a layer's tables are a strided slice), and the lengths."""
    g = torch.Generator().manual_seed(seed)
    P = max(1, -(-max(lens) // S))
    N = B * layers * Hkv * P + 1
    k = torch.randn(N, S, D, generator=g)
    v = torch.randn(N, S, D, generator=g)
    ids = (torch.randperm(N - 1, generator=g) + 1)[: B * layers * Hkv * P]
    tables = ids.view(B, layers, Hkv, P).to(torch.int32)
    q = torch.randn(B, Hkv * G, D, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: see test_without_a_compiler_it_is_unavailable")
@pytest.mark.parametrize(
    "B,Hkv,G,D,S,lens",
    [
        (1, 3, 3, 64, 16, [577]),  # SmolLM2's heads, several 128-token blocks and a partial page
        (4, 2, 4, 40, 4, [1, 130, 128, 257]),  # D not a multiple of the vector width
        (3, 1, 1, 16, 1, [5, 0, 9]),  # one-token pages; an empty row gets zeros
        (2, 4, 16, 128, 8, [300, 17]),  # the kernel's largest group
        (3, 2, 4, 128, 16, [200, 33, 129]),  # a shape the kernel inlines (D 128, G 4)
    ],
)
@pytest.mark.parametrize("threads", [1, 3, None])  # None: set_row_threads' count
@pytest.mark.parametrize("pages", [torch.float32, torch.float16])
def test_matches_reference(B, Hkv, G, D, S, lens, threads, pages, monkeypatch):
    if pages == torch.float16 and not cpu_native.kv_float16():
        pytest.skip("this compiler has no _Float16: the kernels read float32 pages only")
    monkeypatch.setattr(cpu_native, "_row_threads", 2)
    q, k, v, tables, seq_lens = _case(B, Hkv, G, D, S, lens)
    k, v = k.to(pages), v.to(pages)  # float16 pages: the reference reads the same values widened
    for layer in range(tables.shape[1]):
        ref = paged_decode_attention_ref(q, k.float(), v.float(), tables[:, layer], seq_lens)
        out = cpu_native.paged_decode_attention_cpu(
            q, k, v, tables[:, layer], seq_lens, D**-0.5, threads=threads)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    empty = [i for i, n in enumerate(lens) if n == 0]
    if empty:
        assert out[empty].abs().max().item() == 0.0


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_writes_into_out_and_refuses_bad_inputs():
    q, k, v, tables, seq_lens = _case(2, 2, 2, 32, 8, [20, 9])
    out = torch.full_like(q, float("nan"))
    got = cpu_native.paged_decode_attention_cpu(q, k, v, tables[:, 0], seq_lens, 32**-0.5, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables[:, 0], seq_lens), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="int32"):
        cpu_native.paged_decode_attention_cpu(q, k, v, tables[:, 0].long(), seq_lens, 1.0)
    with pytest.raises(ValueError, match="exceed"):  # past the tables: refused, never read
        cpu_native.paged_decode_attention_cpu(q, k, v, tables[:, 0, :, :1], seq_lens, 1.0)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_native.paged_decode_attention_cpu(q.double(), k, v, tables[:, 0], seq_lens, 1.0)
    assert cpu_native.supports(q, k.half(), 2) == cpu_native.kv_float16()
    assert not cpu_native.supports(q, k.bfloat16(), 2)
    with pytest.raises(ValueError, match="unsupported"):  # K and V pages of different types
        cpu_native.paged_decode_attention_cpu(q, k, v.half(), tables[:, 0], seq_lens, 1.0)
    assert not cpu_native.supports(torch.zeros(1, 34, 8), k, 2)  # 17 query heads a KV head


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernels built (or not) anew into an empty cache folder, which it yields; the
    process's own build is loaded again afterwards."""
    monkeypatch.setenv("SPIN_CLUSTER_KERNEL_CACHE", str(tmp_path))
    cpu_native._library.cache_clear()
    yield tmp_path
    cpu_native._library.cache_clear()


def test_without_a_compiler_it_is_unavailable(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    assert not cpu_native.available()
    q, k, v, tables, seq_lens = _case(1, 1, 1, 16, 4, [3])
    with pytest.raises(RuntimeError, match="not available"):
        cpu_native.paged_decode_attention_cpu(q, k, v, tables[:, 0], seq_lens, 0.25)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_loading_it_keeps_subnormal_floats(fresh_build):
    # a library linked with -ffast-math would set flush-to-zero for the whole process
    assert cpu_native.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    assert (tiny * 1.0).item() > 0.0 and (tiny + 0.0).item() > 0.0
    assert 5e-324 * 1.0 > 0.0  # and in Python's doubles


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_builds_into_its_cache_once(fresh_build):
    assert cpu_native.available()
    built = list(fresh_build.glob("cpu_native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_native._library.cache_clear()
    assert cpu_native.available()
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    assert [p.name for p in fresh_build.iterdir()] == [built[0].name]  # no temporary left


# ---- fused layer ops against layer_ops' references ----------------------------------------


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize("T,E", [(1, 576), (5, 40), (3, 17)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(T, E, with_residual):
    from spin_cluster.kernels.layer_ops import add_rms_norm_ref

    g = torch.Generator().manual_seed(T * E)
    wide = torch.randn(T, 2 * E, generator=g)
    x = wide[:, :E]  # strided rows, as a fused GEMM's output
    residual = torch.randn(T, E, generator=g) if with_residual else None
    weight = torch.randn(E, generator=g)
    out, res = cpu_native.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    with pytest.raises(ValueError, match="float32"):
        cpu_native.add_rms_norm(x.double(), None, weight.double(), 1e-5)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 9, 3, 64), (4, 4, 2, 8)])
def test_rope_qkv_matches_reference(T, H, Hkv, D):
    from spin_cluster.kernels.layer_ops import rope_qk_ref

    g = torch.Generator().manual_seed(H * D)
    fused = torch.randn(T, (H + 2 * Hkv) * D, generator=g)  # one q/k/v GEMM's output
    q, k, v = (t.view(T, -1, D) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    angles = torch.rand(T, 1, D // 2, generator=g) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin[..., : D // 2].neg_()
    q2, k2, v2 = cpu_native.rope_qkv(q, k, cos, sin, v)
    rq, rk = rope_qk_ref(q, k, cos, sin)
    torch.testing.assert_close(q2, rq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k2, rk, atol=1e-6, rtol=1e-6)
    assert torch.equal(v2, v) and v2.is_contiguous() and q2.is_contiguous()
    with pytest.raises(ValueError, match="D even"):
        cpu_native.rope_qkv(q[..., :-1], k[..., :-1], cos[..., :-1], sin[..., :-1])


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_silu_mul_matches_reference():
    from spin_cluster.kernels.layer_ops import silu_mul_ref

    g = torch.Generator().manual_seed(1)
    both = torch.randn(3, 2 * 1536, generator=g) * 30  # far into both tails of silu
    gate, up = both.split(1536, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate, up), silu_mul_ref(gate, up), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one shape"):
        cpu_native.silu_mul(gate, up[:, :-1])


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize(("T", "K", "N", "threads"), [(1, 576, 960, 1), (2, 576, 1539, 2), (3, 40, 7, 2),
                                                      (4, 96, 1026, 3), (1, 1, 4, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_matches_f_linear(T, K, N, threads, with_bias):
    # N past a multiple of four (the tail), shares of threads, rows of x strided (a wider buffer)
    g = torch.Generator().manual_seed(T * 1000 + N)
    x = torch.randn(T, K + 5, generator=g)[:, :K]
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    torch.testing.assert_close(cpu_native.linear_rows(x, w, b, threads=threads), torch.nn.functional.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_linear_rows_refuses_what_it_cannot_take():
    w = torch.randn(8, 16)
    for x, weight in [(torch.randn(5, 16), w), (torch.randn(0, 16), w), (torch.randn(2, 15), w),
                      (torch.randn(2, 16), w.T.contiguous().T), (torch.randn(2, 16, dtype=torch.float64), w.double())]:
        with pytest.raises(ValueError, match="linear_rows takes"):
            cpu_native.linear_rows(x, weight)


def _window_reference(q, k, v, context_start, window, key_start):
    """The oracle: SDPA's math kernel in float64 over an explicit mask (the query at p sees
    keys p - window + 1 .. p; every earlier one without a window)."""
    n, T = q.shape[0], k.shape[1]
    qp = torch.arange(context_start, context_start + n)[:, None]
    kp = torch.arange(key_start, key_start + T)[None, :]
    mask = kp <= qp
    if window:
        mask &= kp > qp - window
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(), k[None].double(), v[None].double(), attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1).float()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize(("n", "H", "Hkv", "D", "cs", "window", "key_start"), [
    (37, 9, 3, 64, 0, None, 0),  # SmolLM2's heads, a whole prompt shorter than a key tile
    (200, 9, 3, 64, 100, None, 0),  # a later chunk: every context key, then the causal square
    (130, 4, 1, 256, 0, None, 0),  # Gemma 3's heads (one KV head, D 256)
    (300, 4, 1, 256, 700, 512, 300),  # a sliding-window layer's later chunk, keys from 300
    (5, 8, 2, 72, 3, None, 0),  # D past a multiple of the vector width
    (64, 2, 2, 16, 0, 7, 0),  # a window shorter than a key tile: tiles wholly masked for a row
    (1, 16, 1, 8, 999, None, 0),  # one query row (a decode row through prefill) after 999 keys
])
@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_attention_matches_sdpa(n, H, Hkv, D, cs, window, key_start, threads):
    g = torch.Generator().manual_seed(n * 7 + D)
    T = cs + n - key_start
    q = torch.randn(n, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g).transpose(0, 1)  # the chunk's [T, Hkv, D] read as [Hkv, T, D]
    v = torch.randn(T, Hkv, D, generator=g).transpose(0, 1)
    got = cpu_native.prefill_attention_cpu(q, k, v, cs, window, key_start, threads=threads)
    torch.testing.assert_close(got, _window_reference(q, k, v, cs, window, key_start), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_prefill_attention_refuses_what_it_cannot_take():
    q, k = torch.randn(4, 6, 16), torch.randn(4, 4, 16)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        cpu_native.prefill_attention_cpu(q, k, k, 0)
    q, k = torch.randn(4, 4, 16), torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="do not reach"):  # three keys for queries up to position 3
        cpu_native.prefill_attention_cpu(q, k, k, 0)
    assert not cpu_native.supports_prefill(q.double(), k.double())
    assert not cpu_native.supports_prefill(torch.randn(4, 4, 512), torch.randn(2, 4, 512))  # D past 256


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_the_thread_pool_serves_calls_from_several_threads_and_after_a_fork():
    """The kernels' workers persist between calls (shares are claimed per call's generation):
    calls in a row, calls from two Python threads at once (ctypes lets go of the GIL) and a
    call in a forked child (no workers there: its caller runs every share) all match the
    reference."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    q, k, v, tables, lens = _case(6, 3, 3, 64, 16, [577, 40, 300, 129, 1, 64])
    want = paged_decode_attention_ref(q, k, v, tables[:, 1], lens)  # scale D ** -0.5 = 0.125

    def call(_=None):
        return cpu_native.paged_decode_attention_cpu(q, k, v, tables[:, 1], lens, 0.125, threads=4)

    for _ in range(50):
        torch.testing.assert_close(call(), want, atol=2e-5, rtol=1e-4)
    with ThreadPoolExecutor(2) as pool:
        for got in pool.map(call, range(40)):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_forked_call, args=(q, k, v, tables[:, 1], lens, want))
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the forked call failed or hung (exit code {child.exitcode})"


def _forked_call(q, k, v, tables, lens, want):
    got = cpu_native.paged_decode_attention_cpu(q, k, v, tables, lens, 0.125, threads=4)
    raise SystemExit(0 if torch.allclose(got, want, atol=2e-5, rtol=1e-4) else 1)
