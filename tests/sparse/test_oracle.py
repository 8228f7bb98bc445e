"""oracle: pages ranked by the true attention mass, the upper bound of the accuracy studies."""

import torch

from spin_cluster.sparse import get_algorithm


def _oracle(P=4, S=4, Hkv=2, D=8, R=2):
    return get_algorithm("oracle")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                   max_seqs=R, max_pages_per_seq=P, device=torch.device("cpu"))


def test_scores_are_the_attention_mass_of_each_page(one_row):
    alg = _oracle()
    k, q = one_row(alg)  # 13 keys in row 1, G = 2
    scores = alg.score(0, q, torch.tensor([1]), 4)  # [1, Hkv, 4]
    for h in range(2):
        probs = (q[0, 2 * h : 2 * h + 2] @ k[:, h].T / 8**0.5).softmax(-1)  # [G, T]
        mass = torch.stack([probs[:, 4 * p : 4 * p + 4].sum() for p in range(4)])
        torch.testing.assert_close(scores[0, h], mass, rtol=1e-5, atol=1e-6)
    assert torch.allclose(scores.sum(-1), torch.full((1, 2), 2.0))  # G heads, each summing to 1


def test_a_reused_row_attends_only_to_its_new_tokens():
    alg = _oracle()
    alg.on_append(0, torch.zeros(16, dtype=torch.long), torch.arange(16), torch.randn(16, 2, 8))
    alg.on_append(0, torch.zeros(5, dtype=torch.long), torch.arange(5), torch.randn(5, 2, 8))  # a new request
    scores = alg.score(0, torch.randn(1, 4, 8), torch.tensor([0]), 4)
    assert (scores[..., 2:] == 0).all() and torch.allclose(scores.sum(-1), torch.full((1, 2), 2.0))


def test_a_whole_context_budget_gives_the_dense_tokens(offloaded_tokens, dense_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "oracle", "budget": 256})
    assert tokens == dense_tokens
