"""The lookup epilogue kernel (under TRITON_INTERPRET=1 on the CPU) against its torch
reference: the misses' host pages, per-head lengths and the write-through slots."""

import pytest
import torch

from spin_cluster.kernels.lookup_epilogue import lookup_epilogue, lookup_epilogue_ref

from .conftest import check_impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(B, H, K, R, L, E, S, seed):
    g = torch.Generator().manual_seed(seed)
    n_seg = max(6, K // E + 2)  # room for K distinct pages
    directory = torch.randperm(R * L * H * n_seg, generator=g).int().view(R, L, H, n_seg)
    want = torch.full((B, H, K), -1, dtype=torch.int64)
    num = torch.randint(1, K + 1, (B, H), generator=g)
    for b in range(B):
        for h in range(H):
            want[b, h, : num[b, h]] = torch.randperm(n_seg * E, generator=g)[: num[b, h]].sort().values
    slots = torch.where(want >= 0, torch.randint(0, 1000, want.shape, generator=g), 0).int()
    miss = (torch.rand(want.shape, generator=g) < 0.4) & (want >= 0)
    rows = torch.randperm(R, generator=g)[:B]
    tail = torch.randint(1, S + 1, (B,), generator=g).int()
    to = dict(device=DEVICE)
    return [t.to(**to) for t in (want, slots, miss, num, rows, tail, directory)]


@pytest.mark.parametrize("shape", [(3, 2, 7, 5, 3, 4, 16), (1, 4, 40, 2, 2, 8, 4), (4, 1, 1, 4, 1, 2, 32)])
def test_kernel_equals_reference(shape):
    B, H, K, R, L, E, S = shape
    args = make_case(B, H, K, R, L, E, S, seed=sum(shape))
    for layer in range(L):
        got = lookup_epilogue(*args, layer, E, S, impl="triton")
        want = lookup_epilogue_ref(*args, layer, E, S)
        for x, y, name in zip(got, want, ("src", "lens", "tail_slot")):
            assert x.dtype == y.dtype and torch.equal(x, y), name
    src, lens, tail_slot = got
    assert (src >= 0).sum() == args[2].sum()  # one host page per miss, -1 elsewhere
    # The reference itself, by hand for one head: its last selected page's slot and length.
    want_t, slots, _, num, _, tail, _ = (t.cpu() for t in args)
    n = int(num[0, 0])
    assert int(lens[0, 0]) == (n - 1) * S + int(tail[0])
    assert int(tail_slot[0]) == int(slots[0, 0, n - 1]) * S + int(tail[0]) - 1


def test_shapes_are_checked():
    args = make_case(2, 2, 4, 3, 1, 4, 8, seed=0)
    with pytest.raises(ValueError, match="num_selected"):
        lookup_epilogue_ref(*args[:3], args[3][:1], *args[4:], 0, 4, 8)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_kernel_equals_reference_at_llama_shapes():
    """4 requests x 8 KV heads x 540 selected pages (S-HPLB's widest), pages of 32."""
    args = make_case(4, 8, 540, 16, 2, 16, 32, seed=11)
    for layer in range(2):
        for x, y in zip(lookup_epilogue(*args, layer, 16, 32, impl="triton"), lookup_epilogue_ref(*args, layer, 16, 32)):
            assert torch.equal(x, y)


def test_impl_choice():
    check_impls(lookup_epilogue, lookup_epilogue_ref,
                lambda: ([*make_case(3, 2, 7, 5, 3, 4, 16, seed=5), 1, 4, 16], {}))
