import pytest
import torch

from spin_cluster.kernels.page_select import (
    label_append,
    label_append_ref,
    label_query,
    label_query_ref,
    label_scores,
    label_scores_ref,
    page_scores,
    page_scores_ref,
    select_ragged,
    select_ragged_ref,
    topk_ragged,
    topk_ragged_ref,
)

from .conftest import check_impls


def _index(N=9, hkv=2, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(N, hkv, D, generator=g), torch.randn(N, hkv, D, generator=g)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    kmin[-1], kmax[-1] = float("inf"), float("-inf")  # a page never written
    return kmin, kmax


@pytest.mark.parametrize("group", [1, 4])
def test_page_scores_kernel_equals_reference_and_bounds_every_key(group):
    g = torch.Generator().manual_seed(1)
    kmin, kmax = _index()
    q = torch.randn(3, 2 * group, 16, generator=g)
    pages = torch.tensor([[0, 1, 2, 8], [3, 4, 5, 6], [7, 8, 0, 0]])
    ref = page_scores_ref(q, kmin, kmax, pages)
    got = page_scores(q, kmin, kmax, pages, impl="triton")
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert ref[0, :, 3].abs().max() == 0  # never-written page
    # Any key inside the bounds scores at most the page's score.
    t = torch.rand(16, generator=g)
    key = kmin[4, 1] + t * (kmax[4, 1] - kmin[4, 1])
    qs = q[1, group : 2 * group]  # query heads of KV head 1
    assert (qs @ key).sum() <= ref[1, 1, 1] + 1e-4


def test_topk_ragged_kernel_equals_reference_with_ties_and_minus_inf():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 2, 40, generator=g)
    scores[0, 0, [5, 9, 30]] = 7.0  # a three-way tie at the top
    scores[1, 1, :35] = float("-inf")  # only 5 valid pages
    budgets = torch.tensor([[2, 6], [0, 9], [40, 1]])
    ref = topk_ragged_ref(scores, budgets, 8)
    got = topk_ragged(scores, budgets, 8, impl="triton")
    assert torch.equal(got, ref)
    assert ref[0, 0].tolist() == [5, 9] + [-1] * 6  # ties: lowest indices first
    assert ref[1, 0].tolist() == [-1] * 8
    assert ref[1, 1].tolist() == [35, 36, 37, 38, 39, -1, -1, -1]
    assert (ref[2, 0] >= 0).sum() == 8  # budget above k: k pages


def test_topk_ragged_random_rows():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 3, 200, generator=g).round(decimals=1)  # many ties
    budgets = torch.randint(0, 30, (4, 3), generator=g)
    assert torch.equal(topk_ragged(scores, budgets, 24, impl="triton"), topk_ragged_ref(scores, budgets, 24))


def test_topk_ragged_keys_that_share_leading_bytes():
    """Radix select resolves the threshold byte by byte: scores equal in their first 3 bytes
    (1 + tiny steps), of both signs, with +inf and zeros among them."""
    g = torch.Generator().manual_seed(4)
    base = torch.tensor([1.0, -1.0, 0.0, -0.0, float("inf"), 3e-39])
    steps = torch.randint(0, 6, (2, 2, 300), generator=g)
    scores = base[torch.randint(0, 6, (2, 2, 300), generator=g)] + steps * 1e-7
    budgets = torch.tensor([[1, 17], [150, 299]])
    assert torch.equal(topk_ragged(scores, budgets, 160, impl="triton"), topk_ragged_ref(scores, budgets, 160))


@pytest.mark.parametrize("P", [64, 70])
def test_a_threshold_the_first_bytes_settle_skips_the_later_passes(P):
    """Scores 2^e of both signs split in their first one or two bytes: the radix passes stop
    there (the digit's bin taken whole), and the pages are still the reference's, in one
    tile and in two, with ties inside a settled bin and inside an unsettled one."""
    g = torch.Generator().manual_seed(P)
    sign = torch.where(torch.rand(2, 2, P, generator=g) < 0.3, -1.0, 1.0)
    scores = sign * 2.0 ** torch.randint(-30, 30, (2, 2, P), generator=g).float()
    scores[1, 0, 10:14] = 0.75  # a tie that one budget cuts through
    budgets = torch.tensor([[1, 5], [12, P - 8]])
    assert torch.equal(topk_ragged(scores, budgets, P, impl="triton"), topk_ragged_ref(scores, budgets, P))
    num_pages = torch.tensor([P, P - 3])
    want, count = select_ragged(scores, num_pages, 1, 2, budgets, P, impl="triton")
    ref_want, ref_count = select_ragged_ref(scores, num_pages, 1, 2, budgets, P)
    assert torch.equal(want, ref_want) and torch.equal(count, ref_count)


@pytest.mark.parametrize("P", [64, 70])
def test_the_first_pass_starts_where_the_keys_differ(P):
    """The radix starts at the highest bit where a row's valid keys differ: rows of one sign
    within an octave or a few (the window starts mid-exponent), keys that differ only in
    their last bits (a last pass narrower than 8 bits), every key equal (no pass: the ties
    decide), one valid key, and -inf pages around them. In one tile and in two."""
    g = torch.Generator().manual_seed(P)
    scores = torch.full((3, 2, P), float("-inf"))
    scores[0, 0] = 50 + 350 * torch.rand(P, generator=g)  # one sign, three octaves
    scores[0, 1] = 1.5 + 0.1 * torch.rand(P, generator=g)  # within one octave
    ulp = torch.randint(0, 5, (P,), generator=g, dtype=torch.int32)
    scores[1, 0] = (torch.tensor(1.0).view(torch.int32) + ulp).view(torch.float32)  # last 3 bits only
    scores[1, 1, ::3] = 2.5  # every valid key equal, -inf between them
    scores[2, 0, 7] = -3.0  # one valid key
    scores[2, 1] = -(1 + torch.rand(P, generator=g))  # negative, one octave
    scores[2, 1, 20:30] = -1.25  # a tie the budget may cut
    budgets = torch.tensor([[9, 30], [17, 8], [1, 14]])
    k = P - 2
    assert torch.equal(topk_ragged(scores, budgets, k, impl="triton"), topk_ragged_ref(scores, budgets, k))
    num_pages = torch.tensor([P, P - 3, P])
    want, count = select_ragged(scores, num_pages, 1, 2, budgets, P, impl="triton")
    ref_want, ref_count = select_ragged_ref(scores, num_pages, 1, 2, budgets, P)
    assert torch.equal(want, ref_want) and torch.equal(count, ref_count)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="budgets"):
        topk_ragged_ref(torch.zeros(2, 3, 4), torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="pages"):
        page_scores_ref(torch.zeros(1, 2, 4), torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), torch.zeros(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P", [8192, 5120])
def test_full_size_select_on_gpu(index_dtype, P):
    """Llama-3.1-8B attention shapes at 128K tokens (8192 pages of 16; 5120 of 32 as a decode
    step rounds them: two tiles), ragged budgets."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    B, hkv, G, D = 2, 8, 4, 128
    a = torch.randn(B * P + 1, hkv, D, generator=g, device=dev)
    b = torch.randn(B * P + 1, hkv, D, generator=g, device=dev)
    kmin, kmax = torch.minimum(a, b).to(index_dtype), torch.maximum(a, b).to(index_dtype)
    q = torch.randn(B, hkv * G, D, generator=g, device=dev, dtype=torch.bfloat16)
    pages = torch.arange(B, device=dev)[:, None] * P + torch.arange(P, device=dev)
    ref = page_scores_ref(q, kmin, kmax, pages)
    got = page_scores(q, kmin, kmax, pages, impl="triton")
    assert torch.allclose(got, ref, atol=1e-2, rtol=1e-4)
    budgets = torch.randint(0, 129, (B, hkv), generator=g, device=dev)
    assert torch.equal(topk_ragged(ref, budgets, 128, impl="triton"), topk_ragged_ref(ref, budgets, 128))
    num_pages = torch.tensor([P, P - 1000], device=dev)
    got = select_ragged(ref, num_pages, 1, 4, budgets, 133, impl="triton")
    want = select_ragged_ref(ref, num_pages, 1, 4, budgets, 133)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _select_case(seed, B=3, hkv=2, P=70):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, hkv, P, generator=g).round(decimals=1)  # ties
    scores[0, 1, 10:20] = float("-inf")
    num_pages = torch.tensor([P, 5, 37])[:B]
    budgets = torch.randint(0, 12, (B, hkv), generator=g)
    budgets[1, 0] = 30  # more than the request has
    return scores, num_pages, budgets


@pytest.mark.parametrize("sink, local", [(1, 4), (0, 1), (2, 0)])
def test_select_ragged_kernel_equals_reference(sink, local):
    scores, num_pages, budgets = _select_case(5)
    width = sink + 12 + local
    want, count = select_ragged(scores, num_pages, sink, local, budgets, width, impl="triton")
    ref_want, ref_count = select_ragged_ref(scores, num_pages, sink, local, budgets, width)
    assert torch.equal(want, ref_want) and torch.equal(count, ref_count)
    # sink and local pages are always there; budgets cap the middle
    assert (want[2, :, :sink] == torch.arange(sink)).all()
    assert ((want[2] >= 37 - local) & (want[2] < 37)).sum(-1).eq(local).all()
    assert (count <= sink + local + budgets).all()


@pytest.mark.parametrize("sink, local", [(1, 4), (0, 1), (2, 0), (40, 40)])
@pytest.mark.parametrize("seed", [5, 6])
def test_split_row_select_equals_the_reference(sink, local, seed):
    # Chunks of 16 pages over rows of 70: ties across chunks, -inf runs, short rows whose sink
    # and local windows overlap, budgets over a chunk's middle pages.
    scores, num_pages, budgets = _select_case(seed)
    width = min(70, sink + 12 + local)
    want, count = select_ragged(scores, num_pages, sink, local, budgets, width, chunk=16, impl="triton")
    ref_want, ref_count = select_ragged_ref(scores, num_pages, sink, local, budgets, width)
    assert torch.equal(count, ref_count)
    assert torch.equal(want, ref_want)


def test_a_row_past_a_power_of_two_is_two_tiles():
    from spin_cluster.kernels.page_select import row_tiles

    assert row_tiles(5120)[:2] == (4096, 1024)  # a 128K decode width: not one tile of 8192
    assert row_tiles(4096)[:2] == (4096, 0)
    assert row_tiles(70)[:2] == (64, 16)
    assert row_tiles(7000)[:2] == (8192, 0)  # the tail would be as wide as the first tile
    assert row_tiles(12)[:2] == (16, 0)


@pytest.mark.parametrize("P", [64, 70, 80])
def test_ties_across_the_two_tiles_go_to_the_lowest_page(P):
    """Equal scores on both sides of page 64 (the first tile's end): the lowest pages win, as
    the reference's stable top-k gives; budgets that end inside the tie."""
    scores = torch.zeros(2, 2, P)
    scores[..., 60:P] = 1.0  # a tie from page 60 across the boundary to the row's end
    scores[1, 1, P - 4] = 2.0
    num_pages = torch.tensor([P, P - 3])
    budgets = torch.tensor([[3, 6], [1, 9]])
    want, count = select_ragged(scores, num_pages, 1, 2, budgets, 12, impl="triton")
    ref_want, ref_count = select_ragged_ref(scores, num_pages, 1, 2, budgets, 12)
    assert torch.equal(want, ref_want) and torch.equal(count, ref_count)


def test_split_chunk_splits_long_rows_with_narrow_budgets_only():
    from spin_cluster.kernels.page_select import SPLIT_CHUNK, split_chunk

    assert split_chunk(5120, 72) == SPLIT_CHUNK  # 128K tokens, 2K budget: 5 x 72 candidates
    assert split_chunk(4096, 72) == SPLIT_CHUNK
    assert split_chunk(900, 72) == 0  # one chunk
    assert split_chunk(4096, 600) == 0  # wide budgets: candidates ~ the row


def test_impl_choice():
    g = torch.Generator().manual_seed(7)
    kmin, kmax = _index()
    q = torch.randn(2, 4, 16, generator=g)
    pages = torch.tensor([[0, 1, 8, 2], [3, 4, 5, 0]])
    check_impls(page_scores, page_scores_ref, lambda: ([q, kmin, kmax, pages], {}), exact=False)
    scores = torch.randn(2, 2, 20, generator=g)
    budgets = torch.tensor([[3, 0], [5, 20]])
    check_impls(topk_ragged, topk_ragged_ref, lambda: ([scores, budgets, 6], {}))
    num_pages = torch.tensor([20, 9])
    check_impls(select_ragged, select_ragged_ref, lambda: ([scores, num_pages, 1, 2, budgets, 9], {}))
    S, span = 4, 3 * 4  # labels: 2 request rows of 3 pages of 4 tokens, r = 3 channels, a dump row
    labels = torch.randn(2 * span + 1, 2, 3, generator=g)
    qr = torch.randn(2, 2, 3, generator=g)
    lengths = torch.tensor([span, 5, 0])
    check_impls(label_scores, label_scores_ref,
                lambda: ([qr, labels, torch.tensor([1, 0]), lengths, span, 3, S], {}), exact=False)
    q, ids = torch.randn(2, 4, 8, generator=g), torch.tensor([[5, 0, 3], [1, 7, 2]])
    check_impls(label_query, label_query_ref, lambda: ([q, ids], {}))


def test_auto_takes_the_reference_for_rows_past_the_kernel():
    # A row of more than MAX_ROW_PAGES pages does not fit one program: "auto" does not launch.
    from spin_cluster.kernels.page_select import MAX_ROW_PAGES

    scores = torch.randn(1, 1, MAX_ROW_PAGES + 1)
    budgets = torch.tensor([[4]])
    assert torch.equal(topk_ragged(scores, budgets, 4), topk_ragged_ref(scores, budgets, 4))
    with pytest.raises(ValueError, match="pages per row"):
        topk_ragged(scores, budgets, 4, impl="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("Hkv,r", [(2, 4), (3, 6), (1, 2)])
def test_triton_append_equals_reference(dtype, Hkv, r):
    # k a strided view (a fused QKV projection's K), values past e4m3's range, a repeated dump
    # slot. k in float32 but for bf16 labels: the interpreter rounds float32 to bf16 toward
    # zero and e4m3's ties (frequent from bf16 keys) away from zero, where the GPU and torch
    # round to nearest even.
    g = torch.Generator().manual_seed(Hkv * 10 + r)
    T, D, N = 6, 8, 13
    qkv = (torch.randn(T, 3 * Hkv, D, generator=g) * 100).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    qkv[0, Hkv], qkv[1, Hkv] = 1e4, -1e4  # past e4m3's 448 in every channel of head 0
    k = qkv[:, Hkv:2 * Hkv]
    ids = torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(Hkv)])
    slots = torch.tensor([3, 0, 12, 7, 12, 5])

    def fresh():
        return [torch.zeros(N, Hkv, r).to(dtype), k, ids, slots], {}

    # slot 12 written twice with different rows: compare the others, and that 12 is one of them
    def written(_, args):
        lab = args[0].view(torch.uint8) if dtype == torch.float8_e4m3fn else args[0]
        return [lab[:12]]

    check_impls(label_append, label_append_ref, fresh, outputs=written)
    if dtype == torch.float8_e4m3fn:
        lab = torch.zeros(N, Hkv, r, dtype=dtype)
        label_append(lab, k, ids, slots, impl="triton")
        assert torch.isfinite(lab.float()).all() and lab.float().abs().max() == 448.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hkv,G,r", [(2, 1, 3), (3, 4, 5), (1, 4, 2)])
def test_triton_query_equals_reference(dtype, Hkv, G, r):
    # q a strided view (a fused QKV projection's Q); Hkv 3 pads its heads to 4, r = 3 and 5
    # their channels to 4 and 8; each head's channels a different draw, out of order.
    g = torch.Generator().manual_seed(Hkv * 10 + G + r)
    B, D = 3, 16
    q = torch.randn(B, (G + 2) * Hkv, D, generator=g).to(dtype)[:, :G * Hkv]
    ids = torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(Hkv)])
    got = label_query(q, ids, impl="triton")
    assert got.dtype == torch.float32 and torch.equal(got, label_query_ref(q, ids))
    # Each channel the sum of its KV head's G query heads, that head's channel ids[h, c]
    want = torch.stack([q[:, h * G:(h + 1) * G, ids[h]].float().sum(1) for h in range(Hkv)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
