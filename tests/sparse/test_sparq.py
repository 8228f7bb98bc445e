"""sparq: a page's strongest key in the query's largest channels (a study tool)."""

import pytest
import torch

from spin_cluster.sparse import get_algorithm


def _sparq(channels=0, P=4, S=4, Hkv=2, D=8, R=2):
    return get_algorithm("sparq")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=R,
                                  max_pages_per_seq=P, device=torch.device("cpu"), channels=channels)


def test_all_channels_score_each_page_by_its_best_key(one_row):
    alg = _sparq(channels=8)
    k, q = one_row(alg)
    scores = alg.score(0, q, torch.tensor([1]), 4)
    for h in range(2):
        per_key = (q[0, 2 * h : 2 * h + 2] @ k[:, h].T).sum(0)  # [T] summed over the G heads
        best = torch.stack([per_key[4 * p : 4 * p + 4].max() for p in range(4)])
        torch.testing.assert_close(scores[0, h], best, rtol=1e-5, atol=1e-5)


def test_fewer_channels_use_only_each_query_heads_largest(one_row):
    alg = _sparq(channels=2)
    k, q = one_row(alg, seed=1)
    scores = alg.score(0, q, torch.tensor([1]), 4)
    h = 1
    per_key = torch.zeros(13)
    for g in range(2):
        qh = q[0, 2 * h + g]
        top = qh.abs().topk(2).indices
        per_key += k[:, h][:, top] @ qh[top]
    torch.testing.assert_close(scores[0, h, 3], per_key[12], rtol=1e-5, atol=1e-5)  # a one-key page
    assert alg.channels == 2 and _sparq().channels == 2  # default D/4
    with pytest.raises(ValueError, match="channels"):
        _sparq(channels=9)


def test_a_whole_context_budget_gives_the_dense_tokens(offloaded_tokens, dense_tokens):
    engine, tokens = offloaded_tokens({"algorithm": "sparq", "budget": 256})
    assert tokens == dense_tokens


def test_fixed_channels_are_the_rope_pairs_with_the_largest_weights(tmp_path, one_row):
    from safetensors.torch import save_file

    from spin_cluster.sparse.channels import weight_channels

    D, Hkv, G, E = 8, 2, 2, 6
    wq, wk = torch.ones(Hkv * G * D, E), torch.ones(Hkv * D, E)
    wk[0 * D + 1] *= 10  # head 0: channel 1 (pair 1 = channels 1 and 5)
    wq[(1 * G + 1) * D + 6] *= 10  # head 1, its second query head: channel 6 (pair 2 = 2 and 6)
    save_file({"model.layers.0.self_attn.q_proj.weight": wq, "model.layers.0.self_attn.k_proj.weight": wk},
              str(tmp_path / "model.safetensors"))
    got = weight_channels(str(tmp_path), [0], Hkv, D, 2)  # one pair per head
    assert got[0, 0].tolist() == [1, 5] and got[0, 1].tolist() == [2, 6]
    alg = get_algorithm("sparq")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=4, max_seqs=2,
                                 max_pages_per_seq=4, device=torch.device("cpu"), channels=2,
                                 fixed_channels=True, model_path=str(tmp_path))
    k, q = one_row(alg)
    scores = alg.score(0, q, torch.tensor([1]), 4)
    per_key = (q[0, 0:2][:, [1, 5]] @ k[:, 0][:, [1, 5]].T).sum(0)  # head 0 in channels 1, 5
    torch.testing.assert_close(scores[0, 0, 0], per_key[:4].max(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fixed_channels"):
        get_algorithm("sparq")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=4, max_seqs=2,
                               max_pages_per_seq=4, device=torch.device("cpu"), channels=3, fixed_channels=True,
                               model_path=str(tmp_path))


def test_fixed_channels_weigh_the_qk_norms(tiny_gemma3_path, tmp_path):
    """With per-head q/k norms, a channel's weight is its projection's norm times its norm's
    scale (Gemma 3: 1 + weight): a pair whose q scale is zero is never chosen."""
    import shutil

    from safetensors.torch import load_file, save_file

    from spin_cluster.models.config import ModelConfig
    from spin_cluster.sparse.channels import weight_channels

    mc = ModelConfig.from_folder(tiny_gemma3_path)
    D, Hkv, layer = mc.head_dim, mc.num_kv_heads, mc.layer_windows.index(None)
    folder = tmp_path / "gemma"
    shutil.copytree(tiny_gemma3_path, folder)
    before = weight_channels(str(folder), [layer], Hkv, D, 2)[0]  # [Hkv, 2]: each head's best pair
    tensors = load_file(folder / "model.safetensors")
    name = f"model.layers.{layer}.self_attn.q_norm.weight"
    scale = tensors[name]
    for d in before[:, 0].tolist():  # 1 + w = 0: the normed q has nothing in these pairs
        scale[d] = scale[d + D // 2] = -1.0
    save_file(tensors, str(folder / "model.safetensors"))
    after = weight_channels(str(folder), [layer], Hkv, D, 2)[0]
    assert not set(after[:, 0].tolist()) & set(before[:, 0].tolist())
