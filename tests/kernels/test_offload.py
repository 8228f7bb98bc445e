import pytest
import torch

from spin_cluster.kernels.offload import write_tokens, write_tokens_ref

from .conftest import check_impls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_exactly_the_named_slots(dtype):
    g = torch.Generator().manual_seed(0)
    N, S, D, M = 6, 4, 8, 7
    k, v = torch.randn(M, D, generator=g).to(dtype), torch.randn(M, D, generator=g).to(dtype)
    slots = torch.tensor([0, 5, -1, 23, 9, 12, -3])
    poison = torch.full((N, S, D), 7.0, dtype=dtype)
    outs = []
    for impl in ("triton", "torch"):
        dk, dv = poison.clone(), poison.clone()
        write_tokens(dk, dv, k, v, slots, impl=impl)
        outs.append((dk, dv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    flat = outs[0][0].view(-1, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], k[i])
    untouched = torch.ones(N * S, dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0]] = False
    assert (flat[untouched] == 7.0).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="slots"):
        write_tokens_ref(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        write_tokens(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(3, 8, dtype=torch.float16), torch.zeros(3, 8, dtype=torch.float16), torch.zeros(3, dtype=torch.long), impl="triton")


def test_impl_choice():
    def make():
        g = torch.Generator().manual_seed(2)
        k, v = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
        return [torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), k, v, torch.tensor([0, 11, -1, 4, 7])], {}
    check_impls(write_tokens, write_tokens_ref, make)
