"""Retrieve: Triton gather kernel vs pure-torch reference vs an explicit per-page oracle.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 so the kernel runs in Triton's interpreter
on CPU tensors; shapes are kept tiny for that. Every destination is poisoned first, so a test
sees any write outside the targeted slots.
"""

from __future__ import annotations

import functools

import pytest
import torch

import spin_cluster.kernels.retrieve as rt
from spin_cluster.kernels.fp8_pages import FP8_DTYPE, retrieve_pages_fp8, write_tokens_fp8_ref
from spin_cluster.kernels.offload import write_tokens
from spin_cluster.kernels.retrieve import retrieve_pages, retrieve_pages_ref

from .conftest import check_impls

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
POISON = -7.0

needs_triton = pytest.mark.skipif(not rt.triton_available(), reason="triton not importable")
BOTH = [
    pytest.param(functools.partial(retrieve_pages, impl="triton"), marks=needs_triton, id="triton"),
    pytest.param(functools.partial(retrieve_pages, impl="torch"), id="torch"),
]


def make_pools(n_src, n_dst, S, D, dtype, device=DEVICE, seed=0):
    """Random source pools (distinct values per page) and poisoned destination pools."""
    gen = torch.Generator().manual_seed(seed)
    src_k = torch.randn(n_src, S, D, generator=gen).to(dtype).to(device)
    src_v = torch.randn(n_src, S, D, generator=gen).to(dtype).to(device)
    dst_k = torch.full((n_dst, S, D), POISON, dtype=dtype, device=device)
    dst_v = torch.full((n_dst, S, D), POISON, dtype=dtype, device=device)
    return src_k, src_v, dst_k, dst_v


def oracle(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, n):
    """Expected destination pools, by a plain loop over the pairs."""
    exp_k, exp_v = dst_k.clone(), dst_v.clone()
    for i in range(n):
        s, d = int(src_ids[i]), int(dst_ids[i])
        if s >= 0 and d >= 0:
            exp_k[d] = src_k[s]
            exp_v[d] = src_v[s]
    return exp_k, exp_v


def ids(values, dtype=torch.int32, device=DEVICE):
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("fn", BOTH)
def test_copies_named_pages_and_nothing_else(fn):
    src_k, src_v, dst_k, dst_v = make_pools(6, 5, 4, 8, torch.float32)
    fn(src_k, src_v, dst_k, dst_v, ids([4, 0, 5]), ids([1, 3, 0]))
    assert torch.equal(dst_k[1], src_k[4]) and torch.equal(dst_v[1], src_v[4])
    assert torch.equal(dst_k[3], src_k[0]) and torch.equal(dst_v[3], src_v[0])
    assert torch.equal(dst_k[0], src_k[5]) and torch.equal(dst_v[0], src_v[5])
    for slot in (2, 4):  # never targeted
        assert bool((dst_k[slot] == POISON).all()) and bool((dst_v[slot] == POISON).all())


@pytest.mark.parametrize("fn", BOTH)
def test_count_stops_before_stale_entries(fn):
    src_k, src_v, dst_k, dst_v = make_pools(6, 5, 4, 8, torch.float32)
    count = ids([2])
    fn(src_k, src_v, dst_k, dst_v, ids([1, 2, 3, 4]), ids([0, 1, 2, 3]), count)
    assert torch.equal(dst_k[0], src_k[1]) and torch.equal(dst_v[1], src_v[2])
    for slot in (2, 3, 4):  # entries at positions >= count are stale
        assert bool((dst_k[slot] == POISON).all()) and bool((dst_v[slot] == POISON).all())


@pytest.mark.parametrize("fn", BOTH)
def test_negative_ids_skipped(fn):
    src_k, src_v, dst_k, dst_v = make_pools(6, 5, 4, 8, torch.float32)
    fn(src_k, src_v, dst_k, dst_v, ids([-1, 2, 3, -1]), ids([0, -1, 4, -5]))
    assert torch.equal(dst_k[4], src_k[3]) and torch.equal(dst_v[4], src_v[3])
    untouched = torch.tensor([0, 1, 2, 3])
    assert bool((dst_k[untouched] == POISON).all()) and bool((dst_v[untouched] == POISON).all())


@pytest.mark.parametrize("fn", BOTH)
def test_count_zero_and_empty_ids_copy_nothing(fn):
    src_k, src_v, dst_k, dst_v = make_pools(3, 3, 2, 4, torch.float32)
    fn(src_k, src_v, dst_k, dst_v, ids([0, 1]), ids([0, 1]), ids([0]))
    fn(src_k, src_v, dst_k, dst_v, ids([]), ids([]))
    assert bool((dst_k == POISON).all()) and bool((dst_v == POISON).all())


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("S,D", [(4, 16), (3, 5), (16, 32)])
def test_random_ids_match_oracle(fn, dtype, id_dtype, S, D):
    """Random distinct slots, random (repeating) pages, -1 holes, count < M."""
    n_src, n_dst, M = 20, 12, 10
    gen = torch.Generator().manual_seed(S * 100 + D)
    src_k, src_v, dst_k, dst_v = make_pools(n_src, n_dst, S, D, dtype, seed=S + D)
    src_ids = torch.randint(0, n_src, (M,), generator=gen)
    dst_ids = torch.randperm(n_dst, generator=gen)[:M]
    src_ids[torch.tensor([2, 7])] = -1
    dst_ids[5] = -1
    n = 8
    exp_k, exp_v = oracle(src_k.cpu(), src_v.cpu(), dst_k.cpu(), dst_v.cpu(), src_ids, dst_ids, n)
    count = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    fn(
        src_k, src_v, dst_k, dst_v,
        src_ids.to(id_dtype).to(DEVICE), dst_ids.to(id_dtype).to(DEVICE), count,
    )
    assert torch.equal(dst_k.cpu(), exp_k)
    assert torch.equal(dst_v.cpu(), exp_v)


def test_pairs_per_program_grows_past_the_program_target():
    assert [rt.pairs_per_program(m) for m in (1, 2048, 2049, 4097, 17408, 10**7)] == [1, 1, 2, 4, 16, 16]


@needs_triton
@pytest.mark.parametrize("with_count", [False, True])
def test_several_pairs_per_program_match_the_oracle(monkeypatch, with_count):
    """Programs taking 16 pairs each (the target lowered to 2 programs): the last program's
    pairs past M, -1 holes and a count that ends inside a program all stay untouched."""
    monkeypatch.setattr(rt, "_PROGRAMS", 2)
    n_src, n_dst, M = 40, 40, 37
    assert rt.pairs_per_program(M) == 16
    gen = torch.Generator().manual_seed(3)
    src_k, src_v, dst_k, dst_v = make_pools(n_src, n_dst, 2, 8, torch.float32, seed=3)
    src_ids = torch.randint(0, n_src, (M,), generator=gen)
    dst_ids = torch.randperm(n_dst, generator=gen)[:M]
    src_ids[torch.tensor([0, 17, 36])] = -1
    n = 29 if with_count else M
    exp_k, exp_v = oracle(src_k.cpu(), src_v.cpu(), dst_k.cpu(), dst_v.cpu(), src_ids, dst_ids, n)
    count = ids([n]) if with_count else None
    retrieve_pages(src_k, src_v, dst_k, dst_v, src_ids.to(DEVICE), dst_ids.to(DEVICE), count, impl="triton")
    assert torch.equal(dst_k.cpu(), exp_k) and torch.equal(dst_v.cpu(), exp_v)


@needs_triton
def test_strided_pages_and_large_chunks():
    """Pools that are views with a page stride > S*D, and a page split over chunks."""
    S, D = 8, 16  # 128 elements: block=32 gives 4 chunks
    base_src = torch.randn(7, 2, S, D, device=DEVICE)
    base_dst = torch.full((5, 2, S, D), POISON, device=DEVICE)
    src_k, src_v = base_src[:, 0], base_src[:, 1]
    dst_k, dst_v = base_dst[:, 0], base_dst[:, 1]
    retrieve_pages(src_k, src_v, dst_k, dst_v, ids([6, 1]), ids([2, 4]), block=32, impl="triton")
    assert torch.equal(dst_k[2], src_k[6]) and torch.equal(dst_v[2], src_v[6])
    assert torch.equal(dst_k[4], src_k[1]) and torch.equal(dst_v[4], src_v[1])
    assert bool((base_dst[torch.tensor([0, 1, 3])] == POISON).all())


def write_through_case(S, D, dtype, tail_missed: bool, device=DEVICE):
    """Two heads of K = 3 selected pages each (pairs in groups of 3, one row per head), as a
    decode layer's Retrieve: head 0's tail page (its last pair) a miss into slot 5, or a hit
    held in slot 5; head 1's a hit in slot 7 while its group copies other pages, one of its
    pairs dead with destination 7. Returns the pools, ids and rows (k, v [2, D], slots [2])."""
    src_k, src_v, dst_k, dst_v = make_pools(9, 8, S, D, dtype, device=device, seed=5)
    src_ids = ids([3, -1, 8 if tail_missed else -1, 0, -1, 6], torch.int64, device)
    dst_ids = ids([1, 2, 5 if tail_missed else -1, 0, 7, 4], torch.int64, device)
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, D, generator=gen).to(dtype).to(device) for _ in range(2))
    slots = ids([5 * S + S - 1, 7 * S + 1], torch.int64, device)
    return (src_k, src_v, dst_k, dst_v, src_ids, dst_ids), (k, v, slots)


@needs_triton
@pytest.mark.parametrize("tail_missed", [True, False], ids=["tail-miss", "tail-hit"])
@pytest.mark.parametrize("programs", [2048, 1], ids=["pair-a-program", "16-pairs-a-program"])
def test_write_through_rows_land_over_their_pages_as_a_write_after_the_gather(monkeypatch, tail_missed, programs):
    """The fused launch equals the gather followed by ``write_tokens`` (and the reference):
    where the tail page is a miss its copy's row is the new one, not the host's; where it is a
    hit the row is written alone, and a dead pair naming its slot does not stop it."""
    monkeypatch.setattr(rt, "_PROGRAMS", programs)
    S, D = 4, 8
    pools, rows = write_through_case(S, D, torch.bfloat16, tail_missed)
    two = [t.clone() for t in pools]
    retrieve_pages(*two, impl="triton")
    write_tokens(two[2], two[3], *rows, impl="triton")
    ref = [t.clone() for t in pools]
    retrieve_pages_ref(*ref, rows=rows)
    fused = list(pools)
    retrieve_pages(*fused, rows=rows, impl="triton")
    k, v, slots = rows
    for got in (fused, ref):
        assert torch.equal(got[2], two[2]) and torch.equal(got[3], two[3])
    flat_k, flat_v = fused[2].view(-1, D), fused[3].view(-1, D)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    if tail_missed:  # the rest of the tail page is the host's
        assert torch.equal(fused[2][5, :S - 1], pools[0][8, :S - 1])
        assert not torch.equal(pools[0][8, S - 1], k[0])  # a copy over the row would show


@needs_triton
def test_write_through_rows_need_a_group_of_pairs_each():
    pools, (k, v, slots) = write_through_case(4, 8, torch.float32, True)
    with pytest.raises(ValueError, match="groups"):
        retrieve_pages(*pools, rows=(k[:1].repeat(4, 1), v[:1].repeat(4, 1), slots[:1].repeat(4)), impl="triton")
    with pytest.raises(ValueError, match="dtype"):
        retrieve_pages(*pools, rows=(k.half(), v.half(), slots), impl="triton")


@pytest.mark.parametrize("fn", BOTH)
def test_bad_inputs_raise(fn):
    src_k, src_v, dst_k, dst_v = make_pools(4, 4, 2, 8, torch.float32)
    good = ids([0, 1])
    with pytest.raises(ValueError, match="page shape"):
        fn(src_k, src_v, dst_k[:, :1], dst_v[:, :1], good, good)
    with pytest.raises(ValueError, match="dtype"):
        fn(src_k, src_v, dst_k.half(), dst_v.half(), good, good)
    with pytest.raises(ValueError, match="src_v shape"):
        fn(src_k, src_v[:3], dst_k, dst_v, good, good)
    with pytest.raises(ValueError, match="int32 or int64"):
        fn(src_k, src_v, dst_k, dst_v, good.float(), good)
    with pytest.raises(ValueError, match="entries"):
        fn(src_k, src_v, dst_k, dst_v, ids([0, 1, 2]), good)
    with pytest.raises(ValueError, match="one element"):
        fn(src_k, src_v, dst_k, dst_v, good, good, ids([1, 1]))
    with pytest.raises(ValueError, match=r"\[M\]"):
        fn(src_k, src_v, dst_k, dst_v, good[None], good[None])
    with pytest.raises(ValueError, match="contiguous"):
        fn(src_k.transpose(1, 2), src_v.transpose(1, 2), dst_k.transpose(1, 2),
           dst_v.transpose(1, 2), good, good)


@pytest.mark.gpu
def test_unpinned_host_source_rejected():
    src_k, src_v, _, _ = make_pools(4, 4, 2, 8, torch.float32, device="cpu")
    dst_k = torch.zeros(4, 2, 8, device="cuda")
    good = ids([0, 1], device="cuda")
    for fn in (functools.partial(retrieve_pages, impl="triton"), retrieve_pages_ref):
        with pytest.raises(ValueError, match="pinned"):
            fn(src_k, src_v, dst_k, dst_k.clone(), good, good)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [16, 64])
def test_pinned_host_to_cuda_full_size(S):
    """The production path: pinned host pool -> GPU slots, bf16, D=128, 25% of the pages."""
    D, n_host, n_slots = 128, 8192, 2048
    gen = torch.Generator().manual_seed(S)
    host_k = torch.randn(n_host, S, D, generator=gen).to(torch.bfloat16).pin_memory()
    host_v = torch.randn(n_host, S, D, generator=gen).to(torch.bfloat16).pin_memory()
    slot_k = torch.full((n_slots, S, D), POISON, dtype=torch.bfloat16, device="cuda")
    slot_v = torch.full_like(slot_k, POISON)
    src_ids = torch.randperm(n_host, generator=gen)[:n_slots].to("cuda")
    dst_ids = torch.randperm(n_slots, generator=gen).to("cuda")
    n = n_slots - 100
    count = torch.tensor([n], dtype=torch.int32, device="cuda")
    retrieve_pages(host_k, host_v, slot_k, slot_v, src_ids, dst_ids, count, impl="triton")
    torch.cuda.synchronize()
    d, s = dst_ids[:n].cpu(), src_ids[:n].cpu()
    assert torch.equal(slot_k.cpu()[d], host_k[s]) and torch.equal(slot_v.cpu()[d], host_v[s])
    rest = dst_ids[n:]
    assert bool((slot_k[rest] == POISON).all()) and bool((slot_v[rest] == POISON).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-host", "fp8-host"])
@pytest.mark.parametrize("K", [64, 160])  # 2048 pairs, one a program; 5120, four a program
def test_write_through_from_pinned_host_pages_on_cuda(fp8, K):
    """Decode shapes (32 heads of K selected pages, bf16, S=16, D=128): every other head's tail
    page a miss, the others' hits; the fused launch equals the gather then ``write_tokens``,
    bit for bit, and every row lands exact."""
    S, D, R, n_host = 16, 128, 32, 4096
    M = R * K
    gen = torch.Generator().manual_seed(K)
    host = [torch.randn(n_host, S, D, generator=gen).to(torch.bfloat16) for _ in range(2)]
    if fp8:
        pages = [torch.zeros(n_host, S, D, dtype=FP8_DTYPE) for _ in range(2)] + [torch.zeros(n_host, S) for _ in range(2)]
        write_tokens_fp8_ref(*pages, host[0].view(-1, D), host[1].view(-1, D), torch.arange(n_host * S))
        host = pages
    host = [t.pin_memory() for t in host]
    perm = torch.randperm(M + R, generator=gen)
    dst = perm[:M].view(R, K).clone()
    hit_slots = perm[M:]
    src = torch.randint(0, n_host, (R, K), generator=gen)
    src[torch.rand(R, K, generator=gen) < 0.5] = -1
    src[0::2, -1] = torch.randint(0, n_host, (R // 2,), generator=gen)  # even heads: the tail page a miss
    src[1::2, -1] = -1
    off = torch.randint(0, S, (R,), generator=gen)
    tail = torch.where(torch.arange(R) % 2 == 0, dst[:, -1], hit_slots) * S + off
    k, v = (torch.randn(R, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    ids_ = [x.reshape(-1).cuda() for x in (src, dst)]
    rows = (k, v, tail.cuda())
    buf = [torch.randn(M + R, S, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2)]
    gather = retrieve_pages_fp8 if fp8 else retrieve_pages
    two, fused = [t.clone() for t in buf], [t.clone() for t in buf]
    gather(*host, *two, *ids_)
    write_tokens(*two, *rows)
    gather(*host, *fused, *ids_, rows=rows)
    torch.cuda.synchronize()
    assert torch.equal(fused[0], two[0]) and torch.equal(fused[1], two[1])
    assert torch.equal(fused[0].view(-1, D)[rows[2]], k) and torch.equal(fused[1].view(-1, D)[rows[2]], v)


@needs_triton
def test_impl_choice():
    def make():
        pools = make_pools(6, 5, 2, 8, torch.float32, seed=3)
        return [*pools, ids([4, -1, 0, 2]), ids([1, 3, -1, 0]), torch.tensor([3], device=DEVICE)], {}
    check_impls(retrieve_pages, retrieve_pages_ref, make)


@needs_triton
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-host", "fp8-host"])
def test_the_write_through_launches_compile_for_an_h100(fp8):
    """The interpreter runs a kernel's Python, not Triton's compiler: the fused launch (K = 160
    pages a head: several group chunks) and the plain gather are compiled for sm_90 here."""
    from .sm90 import compiled_launches

    S, D, R, K = 16, 128, 4, 160
    host = [torch.zeros(64, S, D, dtype=torch.bfloat16) for _ in range(2)]
    if fp8:
        host = [torch.zeros(64, S, D, dtype=FP8_DTYPE) for _ in range(2)] + [torch.ones(64, S) for _ in range(2)]
    buf = [torch.zeros(R * K, S, D, dtype=torch.bfloat16) for _ in range(2)]
    src, dst = torch.zeros(R * K, dtype=torch.int64), torch.arange(R * K)
    rows = (torch.zeros(R, D, dtype=torch.bfloat16), torch.zeros(R, D, dtype=torch.bfloat16), torch.arange(R) * S)
    gather = retrieve_pages_fp8 if fp8 else retrieve_pages
    module = "_fp8_pages_kernel" if fp8 else "_retrieve_kernel"
    with compiled_launches(module) as launches:
        gather(*host, *buf, src, dst, rows=rows, impl="triton")
        gather(*host, *buf, src, dst, impl="triton")
    assert [name for _, name, *_ in launches] == [launches[0][1]] * 2
