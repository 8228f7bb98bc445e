import pytest
import torch
import torch.nn.functional as F

from spin_cluster.kernels.block_sparse_prefill import (
    block_sparse_prefill,
    block_sparse_prefill_ref,
    causal_block_lists,
    num_query_blocks,
)

from .conftest import check_impls

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _qkv(n, cs, H, Hkv, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g).to(device, dtype)
    k = torch.randn(Hkv, cs + n, D, generator=g).to(device, dtype)
    v = torch.randn(Hkv, cs + n, D, generator=g).to(device, dtype)
    return q, k, v


def _random_lists(Hkv, cs, n, bs, seed, device="cpu"):
    """Ragged lists: the diagonal always, each earlier block with probability 1/2."""
    g = torch.Generator().manual_seed(seed)
    ids, counts = causal_block_lists(Hkv, cs, n, bs)
    keep = (torch.rand(ids.shape, generator=g) < 0.5) & (ids >= 0)
    diag = (torch.arange(num_query_blocks(cs, n, bs)) + cs // bs)[None, :, None]
    keep |= ids == diag
    J = ids.shape[-1]
    order = torch.where(keep, ids, J).sort(-1).values
    return torch.where(order < J, order, -1).int().to(device), keep.sum(-1).int().to(device)


def _dense_causal(q, k, v, cs):
    """Causal SDPA of the chunk against its context (the engine's dense prefill)."""
    n = q.shape[0]
    mask = torch.arange(cs + n)[None, :] <= torch.arange(cs, cs + n)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k[None].float(), v[None].float(),
                                       attn_mask=mask.to(q.device), enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("cs", [0, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_ragged_lists(cs, dtype):
    n, H, Hkv, D, bs = 45, 4, 2, 16, 16
    q, k, v = _qkv(n, cs, H, Hkv, D, dtype, seed=cs)
    ids, counts = _random_lists(Hkv, cs, n, bs, seed=cs + 1)
    assert len(set(counts.flatten().tolist())) > 1  # ragged
    ref = block_sparse_prefill_ref(q, k, v, ids, counts, cs, bs)
    got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, impl="triton")
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # Sparse lists change the result (the test would notice a kernel that ignores them).
    assert not torch.allclose(ref.float(), _dense_causal(q, k, v, cs), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_block_listed_is_dense_causal_attention(dtype):
    n, cs, H, Hkv, D, bs = 40, 21, 6, 2, 24, 16  # D not a power of two, unaligned chunk
    q, k, v = _qkv(n, cs, H, Hkv, D, dtype, seed=3)
    ids, counts = causal_block_lists(Hkv, cs, n, bs)
    dense = _dense_causal(q, k, v, cs)
    for impl in ("torch", "triton"):
        got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, impl=impl)
        assert torch.allclose(got.float(), dense, atol=TOL[dtype], rtol=TOL[dtype])


def test_block_n_tiles_and_padding_past_the_count():
    n, cs, H, Hkv, D, bs = 70, 0, 2, 1, 16, 32
    q, k, v = _qkv(n, cs, H, Hkv, D, torch.float32, seed=4)
    ids, counts = _random_lists(Hkv, cs, n, bs, seed=5)
    ids = torch.cat([ids, torch.full_like(ids[..., :2], 1)], -1)  # junk past num_blocks: never read
    ref = block_sparse_prefill_ref(q, k, v, ids, counts, cs, bs)
    got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, block_n=16, impl="triton")
    assert torch.allclose(got, ref, atol=2e-5)


def test_rows_without_keys_get_zeros():
    n, cs, H, Hkv, D, bs = 20, 0, 2, 1, 16, 16
    q, k, v = _qkv(n, cs, H, Hkv, D, torch.float32, seed=6)
    ids, counts = causal_block_lists(Hkv, cs, n, bs)
    counts = torch.tensor([[0, 2]], dtype=torch.int32)  # query block 0 lists nothing
    for impl in ("torch", "triton"):
        out = block_sparse_prefill(q, k, v, ids, counts, cs, bs, impl=impl)
        assert out[:16].abs().max() == 0
        assert out[16:].abs().min() > 0


def test_causal_block_lists_layout():
    ids, counts = causal_block_lists(1, 40, 30, 16)  # positions 40..69: blocks 2, 3, 4
    assert counts.tolist() == [[3, 4, 5]]
    assert ids[0].tolist() == [[0, 1, 2, -1, -1], [0, 1, 2, 3, -1], [0, 1, 2, 3, 4]]


def test_bad_inputs_raise():
    q, k, v = _qkv(8, 0, 2, 1, 16, torch.float32)
    ids, counts = causal_block_lists(1, 0, 8, 16)
    with pytest.raises(ValueError, match="int32"):
        block_sparse_prefill_ref(q, k, v, ids.long(), counts, 0, 16)
    with pytest.raises(ValueError, match="positions"):
        block_sparse_prefill_ref(q, k, v, ids, counts, 4, 16)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_prefill_ref(q, k, v, ids, counts, 0, 24)
    with pytest.raises(ValueError, match="block_ids"):
        block_sparse_prefill(q, k, v, torch.zeros(1, 2, 1, dtype=torch.int32), counts, 0, 16, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("cs", [0, 4096 + 64])
def test_kernel_at_llama_shapes_on_gpu(cs):
    """Llama-3.1-8B attention (32 q heads, 8 KV heads, d=128, bf16), 4K-token chunk."""
    n, H, Hkv, D, bs = 4096, 32, 8, 128, 128
    q, k, v = _qkv(n, cs, H, Hkv, D, torch.bfloat16, seed=7, device="cuda")
    ids, counts = _random_lists(Hkv, cs, n, bs, seed=8, device="cuda")
    ref = block_sparse_prefill_ref(q, k, v, ids, counts, cs, bs)
    got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, impl="triton")
    assert (got.float() - ref.float()).abs().max() < 2e-2
    ids, counts = causal_block_lists(Hkv, cs, n, bs, device="cuda")
    dense = _dense_causal(q, k, v, cs)
    assert (block_sparse_prefill(q, k, v, ids, counts, cs, bs, impl="triton").float() - dense).abs().max() < 2e-2


def test_128_key_tiles_in_a_128_block_with_an_unaligned_chunk():
    n, cs, H, Hkv, D, bs = 150, 100, 2, 1, 16, 128
    q, k, v = _qkv(n, cs, H, Hkv, D, torch.float32, seed=9)
    ids, counts = causal_block_lists(Hkv, cs, n, bs)
    got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, block_n=128, num_warps=8, num_stages=3, impl="triton")
    assert torch.allclose(got, _dense_causal(q, k, v, cs), atol=2e-5)


def test_autotune_candidates_divide_the_block():
    from spin_cluster.kernels._block_sparse_prefill_kernel import AUTOTUNE_CONFIGS, _prune_configs

    kept = _prune_configs(AUTOTUNE_CONFIGS, {}, BLOCK_SIZE=64)
    assert kept and all(c.kwargs["BLOCK_N"] == 64 for c in kept)
    assert len(_prune_configs(AUTOTUNE_CONFIGS, {}, BLOCK_SIZE=128)) == len(AUTOTUNE_CONFIGS)
    assert not _prune_configs(AUTOTUNE_CONFIGS, {}, BLOCK_SIZE=32)  # smaller blocks launch untuned


@pytest.mark.gpu
def test_every_autotune_candidate_is_correct_on_gpu():
    """Each tile the autotuner may pick, launched explicitly (pointer loads, and on Hopper
    tensor-descriptor loads), against the torch reference."""
    from spin_cluster.kernels._block_sparse_prefill_kernel import AUTOTUNE_CONFIGS

    n, cs, H, Hkv, D, bs = 1024, 320, 32, 8, 128, 128
    q, k, v = _qkv(n, cs, H, Hkv, D, torch.bfloat16, seed=10, device="cuda")
    ids, counts = _random_lists(Hkv, cs, n, bs, seed=11, device="cuda")
    ref = block_sparse_prefill_ref(q, k, v, ids, counts, cs, bs)
    descriptors = [False, True] if torch.cuda.get_device_capability() >= (9, 0) else [False]
    for c in AUTOTUNE_CONFIGS:
        for tma in descriptors:
            got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, block_n=c.kwargs["BLOCK_N"],
                                       num_warps=c.num_warps, num_stages=c.num_stages, tma=tma, impl="triton")
            assert (got.float() - ref.float()).abs().max() < 2e-2, (c, tma)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_descriptor_loads_equal_the_reference(dtype):
    """K/V through tensor descriptors (bulk tensor copies on Hopper), a strided KV layout as
    the engine passes it ([n, Hkv, D] transposed), an unaligned chunk, ragged lists."""
    n, cs, H, Hkv, D, bs = 45, 8, 4, 2, 16, 16
    q, k, v = _qkv(n, cs, H, Hkv, D, dtype, seed=12)
    k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    ids, counts = _random_lists(Hkv, cs, n, bs, seed=13)
    ref = block_sparse_prefill_ref(q, k, v, ids, counts, cs, bs)
    got = block_sparse_prefill(q, k, v, ids, counts, cs, bs, tma=True, impl="triton")
    assert torch.allclose(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match="tma=True"):
        block_sparse_prefill(q.float(), k.float(), v.float(), ids, counts, cs, bs, tma=True, impl="triton")


def test_descriptor_self_check_and_switch(monkeypatch):
    from spin_cluster.kernels.block_sparse_prefill import descriptors_usable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = _qkv(8, 0, 2, 1, 16, torch.bfloat16, device=device)
    hopper = device == "cpu" or torch.cuda.get_device_capability() >= (9, 0)  # the CPU: the interpreter
    assert descriptors_usable(q, k, v) == hopper  # the self-check ran the descriptor kernel and matched
    assert not descriptors_usable(q.float(), k.float(), v.float())
    monkeypatch.setenv("SPIN_PREFILL_TMA", "0")
    assert not descriptors_usable(q, k, v)


def test_impl_choice():
    n, cs, H, Hkv, D, bs = 20, 8, 2, 1, 16, 16

    def make():
        q, k, v = _qkv(n, cs, H, Hkv, D, torch.float32, seed=8)
        return [q, k, v, *_random_lists(Hkv, cs, n, bs, seed=9), cs, bs], {}
    check_impls(block_sparse_prefill, block_sparse_prefill_ref, make, exact=False)
