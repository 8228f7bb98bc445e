import pytest
import torch

from spin_cluster.sparse import get_algorithm


def _quest(P=4, S=4, Hkv=2, D=8, R=2, **options):
    return get_algorithm("quest")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                  max_seqs=R, max_pages_per_seq=P, device=torch.device("cpu"), **options)


def test_score_bounds_every_key_and_is_tight_for_single_key_pages(one_row):
    q_alg = _quest()
    k, q = one_row(q_alg)  # 13 keys in row 1, G = 2
    scores = q_alg.score(0, q, torch.tensor([1]), 4)  # [1, Hkv, 4]
    for h in range(2):
        qh = q[0, 2 * h : 2 * h + 2]  # [G, D]
        for p in range(4):
            keys = k[4 * p : 4 * p + 4, h]  # [<=4, D]
            best = (qh @ keys.T).max(dim=1).values.sum()  # each query head's best key
            assert scores[0, h, p] >= best - 1e-4
        exact_last = (qh @ k[12, h]).sum()
        assert torch.allclose(scores[0, h, 3], exact_last, atol=1e-5)


def test_a_reused_row_forgets_the_previous_request():
    q_alg = _quest()
    big = torch.full((4, 2, 8), 100.0)
    q_alg.on_append(0, torch.zeros(4, dtype=torch.long), torch.arange(4), big)
    small = torch.ones(4, 2, 8)
    q_alg.on_append(0, torch.zeros(4, dtype=torch.long), torch.arange(4), small)
    assert q_alg.kmax[0, 0].max().item() == 1.0


@pytest.mark.parametrize("index_dtype", ["bfloat16", "float16"])
def test_a_16_bit_index_still_bounds_every_key(index_dtype):
    g = torch.Generator().manual_seed(1)
    half, full = _quest(P=8, index_dtype=index_dtype), _quest(P=8)
    assert half.kmin.dtype == getattr(torch, index_dtype)
    k = torch.randn(29, 2, 8, generator=g) * 3
    for alg in (half, full):
        alg.on_append(0, torch.zeros(29, dtype=torch.long), torch.arange(29), k)
    for p in range(8):
        keys = k[4 * p : 4 * p + 4]  # [<=4, Hkv, D]
        assert (half.kmin[0, p].float() <= keys.amin(0)).all() and (half.kmax[0, p].float() >= keys.amax(0)).all()
    q = torch.randn(3, 4, 8, generator=g)
    rows = torch.zeros(3, dtype=torch.long)
    s_half, s_full = half.score(0, q, rows, 8), full.score(0, q, rows, 8)
    assert (s_half >= s_full - 1e-4).all()  # looser bounds: never a lower score
    assert torch.allclose(s_half, s_full, rtol=0.05, atol=0.05)


def test_an_unknown_index_dtype_is_refused():
    with pytest.raises(ValueError, match="index_dtype='int8'.*bfloat16"):
        _quest(index_dtype="int8")


def test_scoring_blocks_bound_every_key_more_tightly(one_row):
    """Bounds per block of 2 tokens in pages of 4: every page still bounds its keys, never
    more loosely than the whole-page bound, and a page of one block scores as plain Quest."""
    plain, fine = _quest(), _quest(score_block_tokens=2)
    k, q = one_row(plain, fine, T=14, seed=3)  # pages of 4, 4, 4, 2 tokens: the tail page has an empty block
    coarse, tight = plain.score(0, q, torch.tensor([1]), 4), fine.score(0, q, torch.tensor([1]), 4)
    assert torch.isfinite(tight).all()  # the tail page's empty block does not poison its score
    assert (tight <= coarse + 1e-5).all() and (tight < coarse - 1e-3).any()
    for h in range(2):
        qh = q[0, 2 * h : 2 * h + 2]
        for p in range(4):
            keys = k[4 * p : 4 * p + 4, h]
            assert tight[0, h, p] >= (qh @ keys.T).max(dim=1).values.sum() - 1e-4
    same = _quest(score_block_tokens=4)
    one_row(same, T=14, seed=3)
    assert torch.equal(same.score(0, q, torch.tensor([1]), 4), coarse)
    with pytest.raises(ValueError, match="score_block_tokens"):
        _quest(score_block_tokens=3)


def _decode_plan(n, budget, Hkv=2, sink=1, local=1):
    from spin_cluster.sparse.select import SelectPlan
    return SelectPlan(num_pages=torch.tensor(n), tail_len=torch.ones(len(n), dtype=torch.int32), sink_pages=sink,
                      local_pages=local, budget_pages=torch.full((len(n), Hkv), budget), max_pages=max(n),
                      max_budget=budget)


@pytest.mark.parametrize("bound", [False, True])
def test_two_level_select_keeping_every_group_is_quests(bound):
    """Group bounds kept in step with the page bounds through appends (a prefill, decode
    tokens, a reused row): with every group kept the two-level Select takes Quest's pages, and
    with few groups kept only pages of the best groups."""
    from spin_cluster.sparse.select import select_layer
    g = torch.Generator().manual_seed(5)
    P, S = 10, 4  # 10 pages a row: groups of 4 pages need a row stride of 12
    sized = dict(index_pages=24) if bound else {}
    plain, wide, narrow = (_quest(P=P, S=S, **sized, **o) for o in ({}, dict(coarse_pages=4, coarse_factor=100),
                                                                     dict(coarse_pages=4, coarse_factor=1)))
    if bound:  # the offloaded cache's segments of 4 pages, handed out in reverse
        ids = torch.tensor([[2, 1, 0], [5, 4, 3]])
        for alg in (plain, wide, narrow):
            alg.bind_pages(ids, 4)
    assert wide.cmin.shape[1] == 24 // 4 + 1  # 2 rows of 12 pages, or 6 segments of 4
    rows = torch.tensor([0, 1])
    old = torch.randn(20, 2, 8, generator=g) * 9
    for alg in (plain, wide, narrow):
        alg.on_append(0, torch.zeros(20, dtype=torch.long), torch.arange(20), old)
    k = torch.randn(37, 2, 8, generator=torch.Generator().manual_seed(6))
    for alg in (plain, wide, narrow):  # row 0 reused by a longer request; row 1 a prefill then decode tokens
        alg.on_append(0, torch.zeros(37, dtype=torch.long), torch.arange(37), k)
        alg.on_append(0, torch.ones(30, dtype=torch.long), torch.arange(30), k[:30] * 2)
        for t in range(30, 36):
            alg.on_append(0, torch.ones(1, dtype=torch.long), torch.tensor([t]), k[t:t + 1])
    q = torch.randn(2, 4, 8, generator=g)
    plan = _decode_plan([10, 9], 3)
    exact = select_layer(plain, 0, q, rows, plan)
    assert all(torch.equal(a, b) for a, b in zip(select_layer(wide, 0, q, rows, plan), exact))
    want, count = select_layer(narrow, 0, q, rows, plan)
    assert count.tolist() == exact[1].tolist()  # sink + 3 middle + local pages each
    for b, n in enumerate([10, 9]):
        for h in range(2):
            middle = [p for p in want[b, h].tolist() if 0 < p < n - 1]
            assert len({p // 4 for p in middle}) == 1  # factor 1, 3 pages: one group of 4 kept
    with pytest.raises(ValueError, match="coarse_pages"):
        _quest(coarse_pages=3)
    with pytest.raises(ValueError, match="segment"):
        _quest(coarse_pages=8, index_pages=32).bind_pages(torch.zeros(2, 1, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="divide the index"):
        _quest(coarse_pages=8, index_pages=20)


def test_two_level_at_a_whole_context_budget_gives_the_dense_tokens(offloaded_tokens, dense_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "quest", "budget": 256, "options": {"coarse_pages": 4}})
    assert engine.runner.attention.algorithm.coarse_pages == 4
    assert tokens == dense_tokens


def test_a_decode_step_leaves_the_last_group_to_the_select():
    """Decode tokens appended without a refresh (``decode_only``): the two-level Select rebuilds
    each request's last group first, so it selects what a refreshed index selects, step after
    step across group boundaries, and leaves the same group bounds."""
    from spin_cluster.sparse.select import select_layer
    g = torch.Generator().manual_seed(8)
    a, b = (_quest(P=16, S=2, coarse_pages=2, coarse_factor=1) for _ in range(2))
    k = torch.randn(30, 2, 8, generator=g)
    rows = torch.tensor([0, 1])
    for alg in (a, b):
        alg.on_append(0, torch.zeros(9, dtype=torch.long), torch.arange(9), k[:9])
        alg.on_append(0, torch.ones(5, dtype=torch.long), torch.arange(5), -k[:5])
    for t in range(12):  # row 0 from 9 tokens, row 1 from 5: pages of 2 tokens, groups of 2 pages
        pos = torch.tensor([9 + t, 5 + t])
        kt = torch.stack([k[9 + t], -k[5 + t]])
        a.on_append(0, rows, pos, kt)
        b.append(0, b.plan_append(rows, pos, decode_only=True), kt)
        n = (pos // 2 + 1).tolist()
        plan = _decode_plan(n, 2)
        q = torch.randn(2, 4, 8, generator=g)
        for x, y in zip(select_layer(a, 0, q, rows, plan), select_layer(b, 0, q, rows, plan)):
            assert torch.equal(x, y), t
    assert torch.equal(a.cmin, b.cmin) and torch.equal(a.cmax, b.cmax)


def test_two_level_index_is_held_whole_though_select_reads_a_sixteenth():
    """The memory split sets aside what the GPU holds: every page's bounds and, two-level, the
    group bounds over them, though one Select reads about the groups' share of them."""
    plain, two = _quest(P=16), _quest(P=16, coarse_pages=4)
    page = 2 * 1 * 2 * 8 * plain.kmin.element_size() / 4  # bytes per token: kmin + kmax over S
    assert plain.index_bytes_held_per_token() == plain.index_bytes_per_token() == page
    assert two.index_bytes_per_token() == page / 4
    assert two.index_bytes_held_per_token() == page * (1 + 1 / 4)
    held = (two.kmin.numel() + two.kmax.numel() + two.cmin.numel() + two.cmax.numel()) * two.kmin.element_size()
    dump_rows = 4 * 2 * 8 * two.kmin.element_size()  # the last row of each of the four arrays
    assert held == two.index_bytes_held_per_token() * two.page_size * two.num_index_pages + dump_rows


@pytest.mark.parametrize("z", [0.0, 1.0, 2.5])
def test_moments_summary_is_each_pages_mean_and_std(z):
    """summary: moments keeps mean -+ z std of each page's keys as its box, appended in a
    prefill chunk that ends inside a page and then one token at a time, and a reused row
    forgets the previous request's sums."""
    g = torch.Generator().manual_seed(3)
    alg = _quest(P=4, summary="moments", moments_z=z)
    old = torch.randn(16, 2, 8, generator=g) * 50
    alg.on_append(0, torch.zeros(16, dtype=torch.long), torch.arange(16), old)  # a previous request in row 0
    k = torch.randn(14, 2, 8, generator=g) * 3 + 1
    alg.on_append(0, torch.zeros(9, dtype=torch.long), torch.arange(9), k[:9])
    for t in range(9, 14):
        alg.on_append(0, torch.zeros(1, dtype=torch.long), torch.tensor([t]), k[t : t + 1])
    for p in range(4):
        keys = k[4 * p : 4 * p + 4]  # [<=4, Hkv, D]
        mean, std = keys.mean(0), keys.std(0, unbiased=False)
        assert torch.allclose(alg.kmin[0, p], mean - z * std, atol=1e-4), p
        assert torch.allclose(alg.kmax[0, p], mean + z * std, atol=1e-4), p
    q = torch.randn(1, 4, 8, generator=g)
    scores = alg.score(0, q, torch.tensor([0]), 4)  # [1, Hkv, 4]: q.mean + z |q|.std over each KV head's G queries
    for h in range(2):
        qh = q[0, 2 * h : 2 * h + 2]  # [G, D]
        for p in range(4):
            keys = k[4 * p : 4 * p + 4, h]
            want = (qh @ keys.mean(0) + z * qh.abs() @ keys.std(0, unbiased=False)).sum()
            assert torch.allclose(scores[0, h, p], want, atol=1e-3)


def test_moments_options_are_checked():
    with pytest.raises(ValueError, match="summary='median'"):
        _quest(summary="median")
    with pytest.raises(ValueError, match="moments_z=-1"):
        _quest(summary="moments", moments_z=-1)
    assert _quest(summary="moments").index_bytes_held_per_token() == 2 * _quest().index_bytes_held_per_token()  # float32 box


def test_moments_at_a_whole_context_budget_give_the_dense_tokens(offloaded_tokens, dense_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "quest", "budget": 256, "options": {"summary": "moments"}})
    assert engine.runner.attention.algorithm.summary == "moments"
    assert tokens == dense_tokens
