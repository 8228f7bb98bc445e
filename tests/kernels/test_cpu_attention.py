"""The CPU decode attention kernel that reads pages in place, against the torch reference.

It builds with the machine's C compiler on first use; without one the engine keeps the
gather path, and these tests check that fallback instead of skipping.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from spin_cluster.kernels import cpu_attention
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
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_reference(B, Hkv, G, D, S, lens, threads):
    q, k, v, tables, seq_lens = _case(B, Hkv, G, D, S, lens)
    for layer in range(tables.shape[1]):
        ref = paged_decode_attention_ref(q, k, v, tables[:, layer], seq_lens)
        out = cpu_attention.paged_decode_attention_cpu(
            q, k, v, tables[:, layer], seq_lens, D**-0.5, threads=threads)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    empty = [i for i, n in enumerate(lens) if n == 0]
    if empty:
        assert out[empty].abs().max().item() == 0.0


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_writes_into_out_and_refuses_bad_inputs():
    q, k, v, tables, seq_lens = _case(2, 2, 2, 32, 8, [20, 9])
    out = torch.full_like(q, float("nan"))
    got = cpu_attention.paged_decode_attention_cpu(q, k, v, tables[:, 0], seq_lens, 32**-0.5, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables[:, 0], seq_lens), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="int32"):
        cpu_attention.paged_decode_attention_cpu(q, k, v, tables[:, 0].long(), seq_lens, 1.0)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_attention.paged_decode_attention_cpu(q.double(), k, v, tables[:, 0], seq_lens, 1.0)
    assert not cpu_attention.supports(q, k.half(), 2)
    assert not cpu_attention.supports(torch.zeros(1, 34, 8), k, 2)  # 17 query heads a KV head


def test_without_a_compiler_it_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPIN_CLUSTER_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_attention._library.cache_clear()
    try:
        assert not cpu_attention.available()
        q, k, v, tables, seq_lens = _case(1, 1, 1, 16, 4, [3])
        with pytest.raises(RuntimeError, match="not available"):
            cpu_attention.paged_decode_attention_cpu(q, k, v, tables[:, 0], seq_lens, 0.25)
    finally:
        cpu_attention._library.cache_clear()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_builds_into_its_cache_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SPIN_CLUSTER_KERNEL_CACHE", str(tmp_path))
    cpu_attention._library.cache_clear()
    try:
        assert cpu_attention.available()
        built = list(tmp_path.glob("cpu_paged_decode-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_attention._library.cache_clear()
        assert cpu_attention.available()
        assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
        assert [p.name for p in tmp_path.iterdir()] == [built[0].name]  # no temporary left
    finally:
        cpu_attention._library.cache_clear()
