"""Block-sparse prefill: mass estimates, block selection and budgets, config, engine wiring."""

import pytest
import torch

from spin_cluster.config import BlockPrefillOptions, SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.dense_attention import prefill_attention
from spin_cluster.sparse.prefill import (
    BlockSparsePrefill,
    block_masses,
    head_needs,
    select_blocks,
    shifted_budgets,
    threshold_blocks,
)


def _qk(n, cs, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(Hkv, cs + n, D, generator=g)


def _exact_masses(q, k, cs, bs):
    """Dense softmax mass of each key block, averaged over each query block's rows and G heads."""
    n, H, D = q.shape
    Hkv, T, _ = k.shape
    p = torch.einsum("nhd,htd->hnt", q, k.repeat_interleave(H // Hkv, 0)) * D**-0.5
    p = p.masked_fill(torch.arange(T)[None, :] > torch.arange(cs, cs + n)[:, None], float("-inf")).softmax(-1)
    rows = torch.arange(cs, cs + n) // bs - cs // bs
    J = -(-T // bs)
    per_block = torch.zeros(H, rows.max() + 1, J).index_add_(1, rows, torch.nn.functional.pad(p, (0, J * bs - T))
                                                              .view(H, n, J, bs).sum(-1))
    m = per_block.view(Hkv, H // Hkv, -1, J).mean(1)
    return m / m.sum(-1, keepdim=True)


@pytest.mark.parametrize("cs", [0, 32])
def test_antidiagonal_masses_at_stride_one_are_the_exact_block_masses(cs):
    q, k = _qk(64, cs)
    got = block_masses(q, k, cs, 16, "antidiagonal", stride=1)
    assert torch.allclose(got, _exact_masses(q, k, cs, 16), atol=1e-5)


@pytest.mark.parametrize("estimator", ["antidiagonal", "pooled", "strided"])
def test_masses_are_causal_distributions(estimator):
    q, k = _qk(50, 21)  # unaligned chunk: blocks 1..4
    m = block_masses(q, k, 21, 16, estimator, stride=4)
    assert m.shape == (2, 4, 5)
    assert torch.allclose(m.sum(-1), torch.ones(2, 4), atol=1e-5)
    for i in range(4):
        assert m[:, i, 2 + i:].abs().sum() == 0  # right of query block i's diagonal (block 1 + i)


def test_selection_keeps_sink_band_and_diagonal_and_takes_the_best_middle_blocks():
    masses = torch.zeros(1, 1, 10)
    masses[0, 0, [3, 6]] = torch.tensor([0.5, 0.3])  # query block 0 = key block 9 (cs = 9 * 16)
    ids, num = select_blocks(masses, torch.tensor([[1]]), 9 * 16, 16, sink_blocks=1, local_blocks=2, max_budget=1)
    assert ids[0, 0].tolist() == [0, 3, 7, 8, 9] and num.tolist() == [[5]]
    ids, num = select_blocks(masses, torch.tensor([[2]]), 9 * 16, 16, 1, 2, max_budget=2)
    assert ids[0, 0, : num[0, 0]].tolist() == [0, 3, 6, 7, 8, 9]


def test_threshold_takes_few_blocks_for_peaked_heads_and_many_for_flat_ones():
    J = 12
    masses = torch.zeros(2, 1, J)
    masses[0, 0, 5] = 0.95  # peaked head
    masses[0, 0, :] += 0.05 / J
    masses[1, 0, :] = 1.0 / J  # flat head
    need = threshold_blocks(masses, (J - 1) * 16, 16, sink_blocks=1, local_blocks=1, threshold=0.9)
    # flat: kept 3 blocks hold 3/12; 0.9 needs 8 more of the 9 middle ones
    assert need.tolist() == [[1], [8]]


def test_head_needs_and_shifted_budgets_keep_the_mean():
    J = 12
    masses = torch.zeros(2, 1, J)
    masses[0, 0, 5] = 1.0
    masses[1, 0, :] = 1.0 / J
    needs = head_needs([masses], (J - 1) * 16, 16, 16, 1, 1, 0.9)
    assert needs == [[pytest.approx(1 / 9), pytest.approx(8 / 9)]]
    shifted = shifted_budgets(needs, 0.25)
    assert sum(shifted[0]) == pytest.approx(0.5)
    assert shifted[0][0] < 0.25 < shifted[0][1]


def _block(options):
    return SpinConfig.from_dict({"sparse": {"prefill": {"algorithm": "block", "options": options}}})


def test_config_section_round_trips_and_rejects_bad_values():
    cfg = _block({"budgets": "per_head", "per_head_budgets": [[0.5, 2]], "block_size": 32, "stride": 4,
                  "estimator": "strided"})
    block = cfg.sparse.prefill.typed_options()
    assert isinstance(block, BlockPrefillOptions) and block.per_head_budgets == ((0.5, 2.0),)
    assert (block.block_size, block.stride, block.estimator, block.budget) == (32, 4, "strided", 0.25)
    assert SpinConfig.from_dict(cfg.to_dict()) == cfg
    assert SpinConfig.from_dict(cfg.to_dict()).sparse.prefill.typed_options() == block
    with pytest.raises(ValueError, match=r"^sparse.prefill.options: 'block' takes no option 'budget_blocks'; "
                                         r"its options: block_size, budget, budgets, coverage, estimator, "):
        _block({"budget_blocks": 3})
    with pytest.raises(ValueError, match=r"^sparse.prefill.options: 'dense' takes no option 'budget'; its options: "
                                         r"none$"):
        SpinConfig.from_dict({"sparse": {"prefill": {"options": {"budget": 0.5}}}})
    for bad, match in (({"block_size": 48}, r"^sparse.prefill.options.block_size=48: use a power of two in 16..128$"),
                       ({"stride": 32, "block_size": 16}, r"^sparse.prefill.options.stride=32: "),
                       ({"budgets": "per_head"}, "per_head_budgets"),
                       ({"threshold": 0}, r"^sparse.prefill.options.threshold=0: must be > 0$"),
                       ({"estimator": "exact"}, r"^sparse.prefill.options.estimator='exact': choose one of "),
                       ({"per_head_budgets": [[0.5, -1]]}, r"^sparse.prefill.options.per_head_budgets must be >= 0")):
        with pytest.raises(ValueError, match=match):
            _block(bad)
    decode = SpinConfig.from_dict({"sparse": {"algorithm": "quest", "options": {"per_head_budgets": [[64, 32.0]]}}})
    assert decode.sparse.per_head_budgets == ((64, 32),)  # decode budgets are whole tokens
    with pytest.raises(ValueError, match=r"^sparse.options.per_head_budgets must be >= 0"):
        SpinConfig.from_dict({"sparse": {"algorithm": "quest", "options": {"per_head_budgets": [[64, -16]]}}})


def test_every_block_selected_is_dense_prefill_and_a_budget_is_not():
    q, k = _qk(70, 30, seed=3)
    v = torch.randn_like(k)
    dense = prefill_attention(q, k, v, 30)
    full = BlockSparsePrefill(BlockPrefillOptions(block_size=16, budget=64), 1, 2, torch.device("cpu"))
    assert torch.allclose(full(0, q, k, v, 30), dense, atol=1e-5)
    assert full.density() == 1.0
    sparse = BlockSparsePrefill(BlockPrefillOptions(block_size=16, budget=1, sink_blocks=0, local_blocks=0), 1, 2,
                                torch.device("cpu"))
    assert not torch.allclose(sparse(0, q, k, v, 30), dense, atol=1e-3)
    assert 0 < sparse.density() < 1


def test_per_head_budgets_are_ragged_per_layer():
    q, k = _qk(16 * 12, 0, seed=4)
    cfg = BlockPrefillOptions(block_size=16, budgets="per_head", sink_blocks=0, local_blocks=0,
                              per_head_budgets=((1, 4), (0.5, 0)))
    sel = BlockSparsePrefill(cfg, 2, 2, torch.device("cpu"))
    _, num = sel.select(0, q, k, 0)
    assert num[:, -1].tolist() == [2, 5]  # diagonal + 1, diagonal + 4
    _, num = sel.select(1, q, k, 0)
    assert num[:, -1].tolist() == [1 + 6, 1]  # half the 11 middle blocks, rounded up
    with pytest.raises(ValueError, match=r"\[3\]\[2\]"):
        BlockSparsePrefill(cfg, 3, 2, torch.device("cpu"))


def _engine(path, prefill, offload=False):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"page_size": 4, "kind": "offloaded" if offload else "paged"},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 40},  # prompts in chunks
        "sparse": {"prefill": prefill, **({"algorithm": "quest", "budget": 32} if offload else {})},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False)


PROMPTS = [list(range(100, 230)), list(range(400, 517))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("offload", [False, True])
def test_engine_sparse_prefill_in_chunks(tiny_llama_path, offload):
    dense = [o.token_ids for o in _engine(tiny_llama_path, {}, offload).generate(PROMPTS, PARAMS)]
    every = _engine(tiny_llama_path, {"algorithm": "block", "options": {"block_size": 16, "budget": 1000}}, offload)
    assert [o.token_ids for o in every.generate(PROMPTS, PARAMS)] == dense
    sparse = _engine(tiny_llama_path, {"algorithm": "block", "options": {"block_size": 16, "budget": 1,
                                                                         "estimator": "pooled"}}, offload)
    assert all(len(o.token_ids) == 6 for o in sparse.generate(PROMPTS, PARAMS))
    assert 0 < sparse.runner.attention.sparse_prefill.density() < 0.7
    sparse.check_integrity()


def test_calibration_matches_uniform_block_count(tiny_llama_path):
    from spin_cluster.models import load_model
    from spin_cluster.sparse.prefill import calibrate

    model = load_model(tiny_llama_path, dtype=torch.float32, device=torch.device("cpu"), progress=False).eval()
    cfg = BlockPrefillOptions(block_size=16, budget=0.25, coverage=0.8)
    cal = calibrate(model, list(range(100, 420)), cfg)
    assert 0 < cal.threshold < 1 and 0 < cal.density < 1
    assert len(cal.per_head_budgets) == 2 and len(cal.per_head_budgets[0]) == 2
    assert sum(map(sum, cal.per_head_budgets)) == pytest.approx(0.25 * 4, abs=0.01)


@pytest.mark.parametrize("cs, n", [(0, 64), (21, 50), (32, 64)])
def test_strided_masses_at_stride_one_are_a_softmax_over_block_mean_keys(cs, n):
    """Stride 1: each query row's softmax over the block-mean keys of its causal blocks,
    summed over a query block's rows and averaged over the G heads."""
    q, k = _qk(n, cs)
    bs, T = 16, cs + n
    J = -(-T // bs)
    counts = torch.tensor([min(bs, T - j * bs) for j in range(J)], dtype=torch.float32)
    k_mean = torch.nn.functional.pad(k, (0, 0, 0, J * bs - T)).view(2, J, bs, 16).sum(2) / counts[:, None]
    logits = torch.einsum("nhd,hjd->hnj", q, k_mean.repeat_interleave(2, 0)) * 16**-0.5  # [H, n, J]
    q_block = torch.arange(cs, T) // bs  # [n]
    p = logits.masked_fill(torch.arange(J)[None, :] > q_block[:, None], float("-inf")).softmax(-1)
    M = int(q_block[-1] - q_block[0] + 1)
    want = torch.zeros(4, M, J).index_add_(1, q_block - q_block[0], p).view(2, 2, M, J).mean(1)
    want = want / want.sum(-1, keepdim=True)
    got = block_masses(q, k, cs, bs, "strided", stride=1)
    assert torch.allclose(got, want, atol=1e-5)


def test_strided_masses_find_the_blocks_a_query_group_attends_to():
    q, k = _qk(256, 0, H=2, Hkv=1, D=16, seed=3)
    q[200:216] += 2.0  # one direction shared by query group 200..215 (both heads) and key block 5
    k[0, 5 * 16:6 * 16] += 2.0
    got = block_masses(q, k, 0, 16, "strided", stride=16)
    assert got[0, 200 // 16].argmax().item() == 5
    assert torch.allclose(got.sum(-1), torch.ones(1, 16), atol=1e-5)
