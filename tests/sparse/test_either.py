"""labels+quest: pages kept by either ranking (rank fusion of labels' and Quest's scores)."""

import pytest
import torch

from spin_cluster.sparse import get_algorithm
from spin_cluster.sparse.either import fuse_ranks, page_ranks


def test_ranks_count_from_the_best_score_nan_last():
    s = torch.tensor([[0.5, 3.0, float("nan"), -1.0, 3.0]])
    assert page_ranks(s).tolist() == [[2, 0, 4, 3, 1]]  # ties by page order; NaN below -1


def test_the_top_k_of_fused_scores_is_the_union_of_each_rankings_best_pages():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, b = torch.randn(3, 2, 40, generator=g), torch.randn(3, 2, 40, generator=g)
        fused = fuse_ranks(a, b)
        ra, rb = page_ranks(a), page_ranks(b)
        for k in (1, 6, 13, 40):
            top = fused.topk(k, dim=-1).indices
            for i in range(3):
                for h in range(2):
                    picked = set(top[i, h].tolist())
                    # Each ranking's first k // 2 pages are in, and the picks are each
                    # ranking's first j pages for one j.
                    assert set(ra[i, h].argsort()[: k // 2].tolist()) <= picked
                    assert set(rb[i, h].argsort()[: k // 2].tolist()) <= picked
                    j = max(min(int(ra[i, h, p]), int(rb[i, h, p])) for p in picked)
                    below = {p for p in range(40) if min(int(ra[i, h, p]), int(rb[i, h, p])) < j}
                    assert below <= picked


def test_both_indexes_are_kept_and_scored(one_row, op_log):
    kw = dict(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, max_seqs=2, max_pages_per_seq=4,
              device=torch.device("cpu"))
    alg, labels, quest = (get_algorithm(n)(**kw) for n in ("labels+quest", "labels", "quest"))
    k, q = one_row(alg, labels, quest)
    rows = torch.tensor([1])
    with op_log() as log:
        got = alg.score(0, q, rows, 4)
    assert not log.syncs(), log.syncs()
    assert torch.equal(got, fuse_ranks(labels.score(0, q, rows, 4), quest.score(0, q, rows, 4)))
    assert alg.index_bytes_per_token() == labels.index_bytes_per_token() + quest.index_bytes_per_token()


def test_a_whole_context_budget_gives_the_dense_tokens(offloaded_tokens, dense_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "labels+quest", "budget": 256})
    assert tokens == dense_tokens


def test_a_small_budget_serves_and_keeps_the_cache_whole(offloaded_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "labels+quest", "budget": 8})  # 2 pages of 4 per head
    assert all(len(t) == 12 for t in tokens)  # the fixture checked the cache's integrity after the run


def test_layers_named_in_the_options_take_one_ranking():
    """quest_layers / labels_layers: those layers (the model's ids, where the index serves only
    some of them) rank by that Select alone, in ranks; the others take the union."""
    kw = dict(num_kv_heads=2, head_dim=8, page_size=4, max_seqs=2, max_pages_per_seq=4, device=torch.device("cpu"))
    layers = dict(num_layers=3, model_layers=(5, 11, 17))
    alg = get_algorithm("labels+quest")(**kw, **layers, quest_layers="11", labels_layers=[17])
    labels, quest = get_algorithm("labels")(**kw, **layers), get_algorithm("quest")(**kw, **layers)
    g = torch.Generator().manual_seed(3)
    for layer in range(3):
        k = torch.randn(13, 2, 8, generator=g)
        for a in (alg, labels, quest):
            a.on_append(layer, torch.full((13,), 1), torch.arange(13), k)
    q = torch.randn(1, 4, 8, generator=g)
    rows = torch.tensor([1])
    a, b = labels.score(0, q, rows, 4), quest.score(0, q, rows, 4)
    assert torch.equal(alg.score(0, q, rows, 4), fuse_ranks(a, b))  # layer 5: both
    assert torch.equal(alg.score(1, q, rows, 4), -page_ranks(quest.score(1, q, rows, 4)).float())  # 11
    assert torch.equal(alg.score(2, q, rows, 4), -page_ranks(labels.score(2, q, rows, 4)).float())  # 17
    with pytest.raises(ValueError, match="not layers this index serves"):
        get_algorithm("labels+quest")(**kw, **layers, quest_layers=[4])
    with pytest.raises(ValueError, match="in both"):
        get_algorithm("labels+quest")(**kw, **layers, quest_layers=[11], labels_layers="5,11")
    with pytest.raises(ValueError, match="layer indices"):
        get_algorithm("labels+quest")(**kw, **layers, quest_layers="x")
