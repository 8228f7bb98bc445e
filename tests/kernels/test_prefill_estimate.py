import pytest
import torch

from spin_cluster.kernels.prefill_estimate import block_mean_keys, strided_block_masses, strided_block_masses_ref

from .conftest import check_impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qk(n, cs, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(Hkv, cs + n + 5, D, generator=g).to(DEVICE, dtype)  # positions past T: never read
    return q, k


@pytest.mark.parametrize("cs,n", [(0, 64), (0, 53), (21, 40), (32, 32), (70, 3)])
@pytest.mark.parametrize("H,Hkv,stride", [(4, 2, 4), (6, 2, 8), (2, 2, 16)])
def test_fused_estimate_matches_the_torch_estimate(cs, n, H, Hkv, stride):
    q, k = _qk(n, cs, H, Hkv, 32, torch.float32)
    want = strided_block_masses_ref(q, k, cs, 16, stride)
    got = strided_block_masses(q, k, cs, 16, stride, block_j=2, impl="triton")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got.sum(-1), torch.ones_like(got[..., 0]), atol=1e-5)


def test_fused_estimate_in_bf16_ranks_the_blocks_as_the_torch_estimate():
    q, k = _qk(90, 38, 4, 1, 64, torch.bfloat16, seed=3)
    want = strided_block_masses_ref(q, k, 38, 16, 4)
    got = strided_block_masses(q, k, 38, 16, 4, block_j=4, impl="triton")
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)


def test_fused_estimate_is_zero_right_of_each_diagonal():
    q, k = _qk(64, 16, 2, 1, 16, torch.float32, seed=1)
    got = strided_block_masses(q, k, 16, 16, 4, block_j=2, impl="triton")  # query blocks 1..4 of key blocks 0..4
    future = torch.arange(5)[None, :] > (1 + torch.arange(4))[:, None]
    assert (got[0].cpu()[future] == 0).all() and (got[0].cpu()[~future] > 0).all()


def test_block_mean_keys_average_only_the_positions_before_num_keys():
    k = torch.arange(2 * 7 * 1, dtype=torch.float32).view(2, 7, 1)
    got = block_mean_keys(k, 5, 4, torch.float32)
    assert got[:, :, 0].tolist() == [[1.5, 4.0], [8.5, 11.0]]


def test_bad_stride_is_refused():
    q, k = _qk(16, 0, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="stride=3 must divide block_size=16"):
        strided_block_masses(q, k, 0, 16, 3, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("cs", [0, 4096 + 64])
def test_fused_estimate_at_llama_shapes_on_gpu(cs):
    """Llama-3.1-8B attention (32 q heads, 8 KV heads, d=128, bf16), 8K-token chunk, the
    TTFT benchmark's stride 16 in 128-position blocks: the masses and their ranking agree."""
    q, k = _qk(8192, cs, 32, 8, 128, torch.bfloat16, seed=5)
    want = strided_block_masses_ref(q, k, cs, 128, 16)
    got = strided_block_masses(q, k, cs, 128, 16, impl="triton")
    torch.testing.assert_close(got, want, atol=1e-3, rtol=2e-2)
    top_got, top_want = got.topk(8, -1).indices, want.topk(8, -1).indices
    same = (top_got[..., :, None] == top_want[..., None, :]).any(-1).float().mean()
    assert same > 0.95


def test_impl_choice():
    check_impls(strided_block_masses, strided_block_masses_ref,
                lambda: ([*_qk(21, 11, 4, 2, 16, torch.float32, seed=4), 11, 16, 4], {}), exact=False)
