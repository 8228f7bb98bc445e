import argparse

import pytest
import torch

from spin_cluster.profiling.seer_train import add_train_gate_parser, calibration_texts, initial_weights, train_gate
from spin_cluster.sparse import get_algorithm
from spin_cluster.sparse.seer_gate import gate_keys, load_gate, save_gate

SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


@pytest.fixture(scope="module")
def mean_key_gate(tmp_path_factory):
    """A gate whose score is exactly q . (page mean key) / sqrt(D): an orthogonal W_q, W_k = [W_q; 0]."""
    path = tmp_path_factory.mktemp("gate") / "mean.safetensors"
    w_q, w_k = initial_weights(1, 2, 8, 8)
    save_gate(path, w_q, w_k, {"model": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 8}, "page_size": 4,
                               "gate_dim": 8})
    return str(path)


@pytest.fixture(scope="module")
def smollm2_gate(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "smollm2.safetensors"
    summary = train_gate(smollm2_path, path, calibration_texts(("json",)), steps=5, page_size=4, seq_len=128,
                         num_seqs=1, queries_per_seq=8)
    assert summary["kl_final"] < summary["kl_initial"]
    return str(path)


def _seer(gate, R=2, P=16, S=4, Hkv=2, D=8, L=1, **kw):
    return get_algorithm("seer")(gate_path=gate, num_layers=L, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                 max_seqs=R, max_pages_per_seq=P, device=torch.device("cpu"), **kw)


def _append(alg, row, k, start=0):
    T = k.shape[0]
    alg.on_append(0, torch.full((T,), row), torch.arange(start, start + T), k)


def test_page_keys_pool_mean_and_max_across_chunks_and_rows(mean_key_gate):
    g = torch.Generator().manual_seed(0)
    alg = _seer(mean_key_gate)
    a, b = torch.randn(23, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    _append(alg, 1, 100 * torch.ones(30, 2, 8))  # a previous request in row 1
    for lo, hi in ((0, 3), (3, 4), (4, 9)):  # row 0 in chunks that end mid-page ...
        _append(alg, 0, a[lo:hi], lo)
    # ... then one call with row 0's next chunk and row 1's first one, as a step lays them out
    rows = torch.cat([torch.zeros(14, dtype=torch.long), torch.ones(9, dtype=torch.long)])
    alg.on_append(0, rows, torch.cat([torch.arange(9, 23), torch.arange(9)]), torch.cat([a[9:], b]))
    for row, k in ((0, a), (1, b)):
        for p in range(-(-k.shape[0] // 4)):
            keys = k[4 * p : 4 * p + 4]
            want = gate_keys(alg.w_k[0], keys.mean(0), keys.amax(0))
            assert torch.allclose(alg.keys[0, row * 16 + p], want, atol=1e-5)


def test_score_shape_determinism_and_a_planted_key_ranks_first(mean_key_gate):
    g = torch.Generator().manual_seed(1)
    alg = _seer(mean_key_gate)
    q = torch.randn(1, 4, 8, generator=g)
    k = 0.1 * torch.randn(40, 2, 8, generator=g)
    k[25, 1] = 5 * q[0, 2:4].sum(0)  # page 6 of KV head 1
    _append(alg, 0, k)
    scores = alg.score(0, q, torch.tensor([0]), 10)
    assert scores.shape == (1, 2, 10)
    assert torch.equal(scores, alg.score(0, q, torch.tensor([0]), 10))
    assert scores[0, 1].argmax().item() == 6
    want = q[0, 2:4].mean(0) @ k[24:28, 1].mean(0) / 8**0.5
    assert torch.allclose(scores[0, 1, 6], want, atol=1e-5)


def test_index_and_select_run_the_same_ops_for_any_token_count_without_host_syncs(op_log, mean_key_gate):
    g = torch.Generator().manual_seed(2)
    logs = []
    for T, pages in ((6, 3), (40, 10)):  # no size-1 dims: einsum may take other paths for them
        alg = _seer(mean_key_gate)
        with op_log() as log:
            alg.on_append(0, torch.arange(T) // (T // 2), torch.arange(T) % (T // 2), torch.randn(T, 2, 8, generator=g))
            alg.score(0, torch.randn(2, 4, 8, generator=g), torch.arange(2), pages)
        assert log.syncs() == []
        logs.append(log.ops)
    assert logs[0] == logs[1]


def test_a_trained_gate_loads_and_scores(smollm2_gate, smollm2_path):
    alg = _seer(smollm2_gate, model_path=smollm2_path, Hkv=3, D=64, L=30)
    assert alg.gate_meta["model"]["architecture"] == "LlamaForCausalLM" and alg.gate_meta["page_size"] == 4
    g = torch.Generator().manual_seed(3)
    for layer in (0, 29):
        alg.on_append(layer, torch.zeros(30, dtype=torch.long), torch.arange(30), torch.randn(30, 3, 64, generator=g))
        scores = alg.score(layer, torch.randn(1, 9, 64, generator=g), torch.tensor([0]), 8)
        assert scores.shape == (1, 3, 8) and scores.isfinite().all()


def test_a_gate_for_another_model_or_page_size_is_refused_with_the_fix(smollm2_gate, tiny_llama_path, tmp_path,
                                                                       monkeypatch):
    # The CLI command, on the tiny model: a gate for a 2-layer model.
    parser = argparse.ArgumentParser()
    add_train_gate_parser(parser.add_subparsers())
    tiny_gate = tmp_path / "tiny.safetensors"
    args = parser.parse_args(["profile", "train-gate", "--model", tiny_llama_path, "--out", str(tiny_gate),
                              "--steps", "2", "--page-size", "4", "--seq-len", "64", "--num-seqs", "1",
                              "--queries-per-seq", "4"])
    assert args.func(args) == 0
    fix = "train a gate for this model with `spin-cluster profile train-gate --model"
    with pytest.raises(ValueError, match=fix):
        _seer(str(tiny_gate), Hkv=3, D=64, L=30)  # SmolLM2's shape
    with pytest.raises(ValueError, match="differs in .*config_sha256"):
        load_gate(smollm2_gate, **SMOLLM2, page_size=4, model_path=tiny_llama_path)
    with pytest.raises(ValueError, match="cache.page_size=16: set cache.page_size=4"):
        load_gate(smollm2_gate, **SMOLLM2, page_size=16)
    monkeypatch.delenv("SPIN_SEER_GATE", raising=False)
    with pytest.raises(ValueError, match="needs a trained gate: set SPIN_SEER_GATE"):
        _seer(None)


def test_train_gate_joins_an_existing_profile_group():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    profile = sub.add_parser("profile").add_subparsers()
    profile.add_parser("run").set_defaults(func="run")
    add_train_gate_parser(sub)
    assert parser.parse_args(["profile", "run"]).func == "run"
    args = parser.parse_args(["profile", "train-gate", "--out", "g.safetensors"])
    assert (args.steps, args.page_size, args.gate_dim, args.model) == (300, 16, 32, None)


def test_seer_with_the_whole_context_as_budget_equals_dense(smollm2_gate, offloaded_tokens, dense_tokens, monkeypatch):
    monkeypatch.setenv("SPIN_SEER_GATE", smollm2_gate)
    sparse = {"algorithm": "seer", "budget": 256, "sink_tokens": 4, "local_tokens": 8}
    assert offloaded_tokens(sparse)[1] == dense_tokens
