import torch

from spin_cluster.partition import get_algorithm


def _quest(P=4, S=4, Hkv=2, D=8, R=2):
    return get_algorithm("quest")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                  max_seqs=R, max_pages_per_seq=P, device=torch.device("cpu"))


def test_score_bounds_every_key_and_is_tight_for_single_key_pages():
    g = torch.Generator().manual_seed(0)
    q_alg = _quest()
    T = 13  # pages of 4, 4, 4, 1 tokens for row 1
    k = torch.randn(T, 2, 8, generator=g)
    q_alg.on_append(0, torch.full((T,), 1), torch.arange(T), k)
    q = torch.randn(1, 4, 8, generator=g)  # G = 2
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
