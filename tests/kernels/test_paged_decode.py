"""Paged decode attention: Triton kernel vs pure-torch reference vs a dense float64 oracle.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 so the kernel runs in Triton's interpreter
on CPU tensors; shapes are kept tiny for that.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import spin_cluster.kernels.paged_decode as pd
from spin_cluster.kernels._triton_support import load_kernel_module
from spin_cluster.kernels.paged_decode import choose_num_splits, paged_decode_attention, paged_decode_attention_ref
from spin_cluster.kernels.paged_decode_cpu import paged_decode_attention_sdpa

from .paged_decode_cases import DEVICE, HAS_CUDA, KERNEL_TOL, RAGGED_16, REF_TOL, assert_close, dense_oracle, make_case

needs_triton = pytest.mark.skipif(not pd.triton_available(), reason="triton not importable")




# --------------------------------------------------------------------------------------
# Reference vs float64 oracle
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_reference_matches_dense_oracle(dtype, group):
    case = make_case(RAGGED_16, group=group, dtype=dtype, seed=group)
    out = paged_decode_attention_ref(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert_close(out, dense_oracle(*case), REF_TOL[dtype])


def test_reference_chunking_and_scale(monkeypatch):
    # A tiny chunk budget forces one (request, KV head) row per chunk, in length order.
    monkeypatch.setattr(pd, "_REF_CHUNK_BYTES", 1)
    monkeypatch.setattr(pd, "_REF_CHUNK_BYTES_CPU_PER_THREAD", 1)
    case = make_case([7, 50, 1, 33, 16, 2], page_size=8, group=4, seed=3)
    out = paged_decode_attention_ref(*case, scale=0.3)
    assert_close(out, dense_oracle(*case, scale=0.3), REF_TOL[torch.float32])


def test_reference_seq_len_zero_gives_zeros():
    case = make_case([0, 9, 0], seed=4)
    out = paged_decode_attention_ref(*case)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    assert_close(out, dense_oracle(*case), REF_TOL[torch.float32])


def test_reference_writes_out():
    case = make_case([3, 20], dtype=torch.bfloat16, seed=5)
    out = torch.full_like(case[0], float("nan"))
    res = paged_decode_attention_ref(*case, out=out)
    assert res is out
    assert_close(out, dense_oracle(*case), REF_TOL[torch.bfloat16])


def test_reference_rejects_overlong_seq_len():
    q, k, v, bt, sl = make_case([16, 20], seed=6)  # P = 2 pages of 16
    sl[1] = 33
    with pytest.raises(ValueError, match="capacity"):
        paged_decode_attention_ref(q, k, v, bt, sl)


# --------------------------------------------------------------------------------------
# Kernel vs reference (interpreted on CPU, compiled on GPU)
# --------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference(dtype, group, num_splits):
    case = make_case(RAGGED_16, group=group, dtype=dtype, seed=10 + group)
    ref = paged_decode_attention_ref(*case)
    out = paged_decode_attention(*case, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, KERNEL_TOL[dtype])
    if dtype == torch.float32:
        assert_close(out, dense_oracle(*case), KERNEL_TOL[dtype])


@needs_triton
@pytest.mark.parametrize(
    "page_size,block_n,head_dim,group",
    [
        (16, 32, 32, 2),  # two pages per block: per-row page ids
        (8, 16, 16, 3),  # G=3 (padded to 16 rows), small pages
        (32, 16, 32, 1),  # two blocks per page
        (12, 16, 24, 2),  # page size and head dim not powers of 2 (masked D)
    ],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_kernel_page_and_block_shapes(page_size, block_n, head_dim, group, num_splits):
    S = page_size
    lens = [1, S, 2 * S + 3, 3 * S - 1]
    case = make_case(lens, page_size=S, head_dim=head_dim, group=group, seed=page_size)
    out = paged_decode_attention(*case, num_splits=num_splits, block_n=block_n)
    assert_close(out, dense_oracle(*case), KERNEL_TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_starts_mask_the_keys_before_them(num_splits, dtype):
    """A sliding window's rows: keys before key_starts[b] are not attended (a start inside the
    first block, one past whole blocks, 0, and a one-token row)."""
    case = make_case([40, 23, 50, 1], group=2, dtype=dtype, seed=31)
    starts = torch.tensor([13, 0, 35, 0], dtype=torch.int32, device=case[0].device)
    ref = paged_decode_attention_ref(*case, key_starts=starts)
    got = paged_decode_attention(*case, num_splits=num_splits, block_n=16, key_starts=starts)
    assert_close(got, ref, KERNEL_TOL[dtype])
    assert_close(ref, dense_oracle(*case, key_starts=starts), REF_TOL[dtype])
    assert not torch.allclose(ref[0].float(), paged_decode_attention_ref(*case)[0].float())  # the mask did something
    with pytest.raises(ValueError, match="key_starts must be"):
        paged_decode_attention(*case, key_starts=starts[:2])


@needs_triton
def test_kernel_more_splits_than_blocks_and_empty_requests():
    # 8 splits over requests of 0..3 blocks: most splits are empty; seq_len 0 gives zeros.
    case = make_case([0, 1, 17, 40, 0], group=2, seed=21)
    out = paged_decode_attention(*case, num_splits=8, block_n=16)
    assert torch.all(out[0] == 0) and torch.all(out[4] == 0)
    assert_close(out, dense_oracle(*case), KERNEL_TOL[torch.float32])
    out1 = paged_decode_attention(*case, num_splits=1, block_n=16)
    assert torch.all(out1[0] == 0) and torch.all(out1[4] == 0)
    assert_close(out1, out, KERNEL_TOL[torch.float32])


@needs_triton
def test_kernel_defaults_out_and_strided_q():
    q, k, v, bt, sl = make_case([5, 30, 16], group=4, dtype=torch.float16, seed=22)
    B, H, D = q.shape
    # q as a strided view (e.g. a slice of a fused QKV projection), out preallocated.
    qkv = torch.zeros(B, 3 * H, D, dtype=q.dtype, device=q.device)
    qkv[:, :H] = q
    q_view = qkv[:, :H]
    assert not q_view.is_contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    res = paged_decode_attention(q_view, k, v, bt, sl, scale=0.2, out=out)
    assert res is out
    ref = paged_decode_attention_ref(q, k, v, bt, sl, scale=0.2)
    assert_close(out, ref, KERNEL_TOL[torch.float16])
    # All defaults (split heuristic, block size, scale).
    assert_close(
        paged_decode_attention(q, k, v, bt, sl),
        paged_decode_attention_ref(q, k, v, bt, sl),
        KERNEL_TOL[torch.float16],
    )


def test_choose_num_splits():
    # Batch 1, 8 KV heads, 128K tokens on 132 SMs: the grid must cover every SM.
    n = choose_num_splits(1, 8, 128 * 1024, 132)
    assert n * 8 >= 132
    # No partial last wave of 4 * 132 resident programs: 256 (request, head) pairs split in 2,
    # not 3 (768 programs = 1.5 waves).
    assert choose_num_splits(32, 8, 32 * 1024, 132) == 2
    # Plenty of (request, head) programs already: no split.
    assert choose_num_splits(128, 8, 32 * 1024, 132) == 1
    # Short contexts are not split into tiny pieces.
    assert choose_num_splits(1, 8, 300, 132) <= math.ceil(300 / pd._MIN_TOKENS_PER_SPLIT)
    assert choose_num_splits(1, 8, 0, 132) == 1
    assert choose_num_splits(1, 1, 10**7, 132) == pd._MAX_SPLITS
    # A sparse step's rows (a head's ~2K selected tokens): splits of 128 tokens, one wave.
    assert choose_num_splits(4, 8, 2048, 132) == 16
    assert choose_num_splits(1, 8, 4096, 132) == 32


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def _bad_cases():
    def mk():
        names = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")
        return dict(zip(names, make_case([3, 20], seed=30)))

    def mod(fn):
        a = mk()
        fn(a)
        return a

    return {
        "q_2d": mod(lambda a: a.update(q=a["q"][:, 0])),
        "k_4d": mod(lambda a: a.update(k_pages=a["k_pages"][None])),
        "v_shape": mod(lambda a: a.update(v_pages=a["v_pages"][:-1])),
        "head_dim": mod(lambda a: a.update(q=a["q"][..., :16])),
        "bt_2d": mod(lambda a: a.update(block_tables=a["block_tables"][:, 0])),
        "bt_batch": mod(lambda a: a.update(block_tables=a["block_tables"][:1])),
        "sl_batch": mod(lambda a: a.update(seq_lens=a["seq_lens"][:1])),
        "sl_2d": mod(lambda a: a.update(seq_lens=a["seq_lens"][:, None])),
        "gqa": mod(lambda a: a.update(q=a["q"][:, :3])),
        "q_int": mod(lambda a: a.update(q=a["q"].to(torch.int32))),
        "q_f64": mod(lambda a: a.update(q=a["q"].double())),
        "kv_dtype": mod(lambda a: a.update(k_pages=a["k_pages"].half())),
        "bt_int64": mod(lambda a: a.update(block_tables=a["block_tables"].long())),
        "sl_int64": mod(lambda a: a.update(seq_lens=a["seq_lens"].long())),
        "not_tensor": mod(lambda a: a.update(seq_lens=[3, 20])),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("fn", [paged_decode_attention_ref, paged_decode_attention_sdpa, paged_decode_attention])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise(fn, case):
    if fn is paged_decode_attention and not pd.triton_available():
        pytest.skip("triton not importable")
    with pytest.raises(ValueError):
        fn(**BAD[case])


@pytest.mark.parametrize("fn", [paged_decode_attention_ref, paged_decode_attention_sdpa, paged_decode_attention])
def test_bad_out_raises(fn):
    if fn is paged_decode_attention and not pd.triton_available():
        pytest.skip("triton not importable")
    q, k, v, bt, sl = make_case([3, 20], seed=31)
    with pytest.raises(ValueError, match="out"):
        fn(q, k, v, bt, sl, out=torch.empty(2, 4, 16, dtype=q.dtype, device=q.device))
    with pytest.raises(ValueError, match="out"):
        fn(q, k, v, bt, sl, out=torch.empty_like(q, dtype=torch.float16))


@needs_triton
def test_kernel_only_checks():
    q, k, v, bt, sl = make_case([3, 20], seed=32)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(q, k, v, bt, sl, block_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k, v, bt, sl, num_splits=0)
    with pytest.raises(ValueError, match="last dimension"):
        paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, sl)
    big = make_case([3], head_dim=512, seed=33)
    with pytest.raises(ValueError, match="head dim"):
        paged_decode_attention(*big)


def test_missing_triton_raises_clearly(monkeypatch):
    """Without Triton the reference still works and the kernel entry says why it cannot run."""
    case = make_case([3, 20], seed=34)
    pkg = sys.modules[pd.__package__]
    load_kernel_module.cache_clear()  # the launchers' lazy imports are cached there
    monkeypatch.delattr(pkg, "_paged_decode_kernel", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, pd.__package__ + "._paged_decode_kernel", None)
    try:
        assert not pd.triton_available()
        with pytest.raises(RuntimeError, match="needs Triton"):
            paged_decode_attention(*case)
        assert_close(paged_decode_attention_ref(*case), dense_oracle(*case), REF_TOL[torch.float32])
    finally:
        load_kernel_module.cache_clear()


# --------------------------------------------------------------------------------------
# Full size on a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_full_size_bf16(num_splits):
    B, H, Hkv, D, S = 4, 32, 8, 128, 16
    lens = [32 * 1024, 1, 17 * 1024 + 5, 4096]
    q, k, v, bt, sl = make_case(
        lens, num_kv_heads=Hkv, group=H // Hkv, head_dim=D, page_size=S,
        dtype=torch.bfloat16, extra_pages=64, seed=40, device="cuda",
    )
    out = paged_decode_attention(q, k, v, bt, sl, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k, v, bt, sl)
    torch.cuda.synchronize()
    assert_close(out, ref, KERNEL_TOL[torch.bfloat16])
    # Small requests also checked against the float64 oracle.
    sub = [1, 3]
    args = (q[sub], k, v, bt[sub], sl[sub])
    assert_close(out[sub], dense_oracle(*args), KERNEL_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (256, 8), (80, 1)])
def test_gpu_head_dims(dtype, head_dim, group):
    lens = [4096, 1, 1000, 2048 + 7]
    case = make_case(
        lens, num_kv_heads=3, group=group, head_dim=head_dim, page_size=16,
        dtype=dtype, seed=41, device="cuda",
    )
    ref = paged_decode_attention_ref(*case)
    for num_splits in (None, 1):
        out = paged_decode_attention(*case, num_splits=num_splits)
        assert_close(out, ref, KERNEL_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_per_head_seq_lens(dtype, num_splits):
    """seq_lens [B, Hkv]: each KV head attends to its own number of tokens (sparse decode)."""
    q, kp, vp, bt, lens = make_case([40, 23, 17], num_kv_heads=3, group=2, dtype=dtype, seed=5)
    per_head = torch.tensor([[40, 1, 16], [23, 9, 0], [17, 17, 5]], dtype=torch.int32, device=q.device)
    ref = paged_decode_attention_ref(q, kp, vp, bt, per_head)
    got = paged_decode_attention(q, kp, vp, bt, per_head, num_splits=num_splits)
    assert_close(got, ref, KERNEL_TOL[dtype])
    # Each head equals a per-request call whose length is that head's.
    G = 2
    for h in range(3):
        one = paged_decode_attention_ref(q, kp, vp, bt, per_head[:, h].contiguous())
        assert_close(ref[:, h * G : (h + 1) * G], one[:, h * G : (h + 1) * G], REF_TOL[dtype])
    assert ref[1, 4:6].abs().max() == 0  # a head with no tokens gives zeros


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_balanced_splits_equal_the_reference(dtype):
    """``split_tokens``: fixed-length splits, a row taking as many as its length needs (heads
    of very different lengths, one empty, one a split's exact multiple), equal the reference
    and the proportional splits."""
    q, kp, vp, bt, lens = make_case([40, 23, 17], num_kv_heads=3, group=2, dtype=dtype, seed=7)
    per_head = torch.tensor([[40, 1, 16], [23, 9, 0], [17, 32, 5]], dtype=torch.int32, device=q.device)
    ref = paged_decode_attention_ref(q, kp, vp, bt, per_head)
    for split_tokens in (16, 32):  # 3 and 2 splits for the longest row
        got = paged_decode_attention(q, kp, vp, bt, per_head, block_n=16, split_tokens=split_tokens)
        assert_close(got, ref, KERNEL_TOL[dtype])
    assert paged_decode_attention(q, kp, vp, bt, per_head, block_n=16, split_tokens=16)[1, 4:6].abs().max() == 0
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode_attention(q, kp, vp, bt, per_head, block_n=16, split_tokens=24)
    with pytest.raises(ValueError, match="neither"):
        paged_decode_attention(q, kp, vp, bt, per_head, block_n=16, split_tokens=16, num_splits=2)


def test_balanced_split_tokens():
    # A wave of programs (4 a SM): 4 x 8 heads of 2112 tokens on 132 SMs -> 128 tokens a split.
    assert pd.balanced_split_tokens(4, 8, 2112, 17152, 132) == 320  # the widest head: <= 64 splits
    assert pd.balanced_split_tokens(4, 8, 2112, 2112, 132) == 128
    assert pd.balanced_split_tokens(16, 8, 2112, 2112, 132) == 512  # 270K tokens over 528 programs
    assert pd.balanced_split_tokens(1, 8, 100, 100, 132) == 128  # never under the floor
    assert pd.balanced_split_tokens(16, 8, 2112, 2112, 132, block_n=32) % 32 == 0
