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


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_second_destination_gets_its_rows_in_the_same_launch(impl):
    """``also``: each row goes to the slot it has in either destination (the host tier or the
    GPU home pages), exactly as two separate writes put it."""
    g = torch.Generator().manual_seed(3)
    M, D = 6, 8
    k, v = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    host_slots = torch.tensor([3, -1, 10, -1, -1, 0])
    gpu_slots = torch.tensor([-1, 7, -1, 2, -1, -1])  # row 4: neither
    want = [torch.full((3, 4, D), 7.0) for _ in range(4)]
    write_tokens_ref(want[0], want[1], k, v, host_slots)
    write_tokens_ref(want[2], want[3], k, v, gpu_slots)
    got = [torch.full((3, 4, D), 7.0) for _ in range(4)]
    write_tokens(got[0], got[1], k, v, host_slots, (got[2], got[3], gpu_slots), impl=impl)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
