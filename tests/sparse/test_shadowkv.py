import torch

from spin_cluster.sparse import get_algorithm



def _alg(R=2, P=16, S=4, Hkv=2, D=8, **kw):
    return get_algorithm("shadowkv")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=R,
                                     max_pages_per_seq=P, device=torch.device("cpu"), **kw)


def _append(alg, row, k, start=0):
    T = k.shape[0]
    alg.on_append(0, torch.full((T,), row), torch.arange(start, start + T), k)


def test_score_is_the_query_against_each_page_mean_key():
    g = torch.Generator().manual_seed(0)
    alg = _alg(outlier_fraction=0.0)
    k = torch.randn(22, 2, 8, generator=g)  # pages of 4, 4, 4, 4, 4, 2 tokens
    _append(alg, 1, k)
    q = torch.randn(3, 4, 8, generator=g)  # G = 2
    scores = alg.score(0, q, torch.tensor([1, 1, 1]), 6)
    assert scores.shape == (3, 2, 6)
    for h in range(2):
        for p in range(6):
            want = q[0, 2 * h : 2 * h + 2].sum(0) @ k[4 * p : 4 * p + 4, h].mean(0)
            assert torch.allclose(scores[0, h, p], want, atol=1e-5)
    assert torch.equal(scores, alg.score(0, q, torch.tensor([1, 1, 1]), 6))  # deterministic


def test_the_page_holding_a_planted_key_ranks_first():
    g = torch.Generator().manual_seed(1)
    alg = _alg(outlier_fraction=0.0)
    q = torch.randn(1, 4, 8, generator=g)
    k = 0.1 * torch.randn(40, 2, 8, generator=g)
    k[25, 1] = 5 * q[0, 2:4].sum(0)  # page 6 of KV head 1
    _append(alg, 0, k)
    scores = alg.score(0, q, torch.tensor([0]), 10)
    assert scores[0, 1].argmax().item() == 6


def test_outlier_pages_rank_first_and_keep_their_order():
    g = torch.Generator().manual_seed(2)
    alg = _alg(outlier_fraction=0.2)  # ceil(0.2 * 10 full pages) = 2 outliers per head
    k = 0.05 * torch.randn(40, 2, 8, generator=g) + torch.ones(8)  # keys close to one direction
    k[8:12, :] = torch.tensor([4.0, -4.0, 4.0, -3.6])[:, None, None] * torch.eye(8)[0]  # page 2: mean 0.1 e0
    k[28:32, :] = torch.tensor([3.0, -3.0, 3.0, -3.0])[:, None, None] * torch.eye(8)[1]  # page 7: mean 0
    _append(alg, 0, k)
    q = torch.ones(1, 4, 8)  # by their means both spread-out pages rank last
    scores = alg.score(0, q, torch.tensor([0]), 10)
    for h in range(2):
        assert set(scores[0, h].topk(2).indices.tolist()) == {2, 7}
    plain = _alg(outlier_fraction=0.0)
    _append(plain, 0, k)
    base = plain.score(0, q, torch.tensor([0]), 10)
    assert base[0].argsort(-1)[:, :2].sort().values.tolist() == [[2, 7], [2, 7]]
    assert (scores[0, :, 2] > scores[0, :, 7]).all() and (base[0, :, 2] > base[0, :, 7]).all()


def test_chunked_appends_equal_one_append_and_a_reused_row_forgets():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(30, 2, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    whole, parts = _alg(), _alg()
    _append(whole, 1, k)
    _append(parts, 1, 100 * torch.ones(37, 2, 8))  # a previous request in the same row
    for lo, hi in ((0, 3), (3, 4), (4, 17), (17, 30)):
        _append(parts, 1, k[lo:hi], lo)
    rows = torch.tensor([1, 1])
    assert torch.allclose(whole.score(0, q, rows, 8), parts.score(0, q, rows, 8), atol=1e-5)


def test_index_and_select_run_the_same_ops_for_any_token_count_without_host_syncs(op_log):
    g = torch.Generator().manual_seed(4)
    logs = []
    for T, pages in ((6, 3), (37, 10)):  # no size-1 dims: einsum may take other paths for them
        alg = _alg()
        with op_log() as log:
            alg.on_append(0, torch.arange(T) % 2, torch.arange(T) // 2, torch.randn(T, 2, 8, generator=g))
            alg.score(0, torch.randn(2, 4, 8, generator=g), torch.arange(2), pages)
        assert log.syncs() == []
        logs.append(log.ops)
    assert logs[0] == logs[1]


def test_shadowkv_with_the_whole_context_as_budget_equals_dense(offloaded_tokens, dense_tokens):
    sparse = {"algorithm": "shadowkv", "budget": 256, "sink_tokens": 4, "local_tokens": 8}
    assert offloaded_tokens(sparse)[1] == dense_tokens
