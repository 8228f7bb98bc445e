"""labels: a label cache of r fixed channels per key; a page scores its best token."""

import pytest
import torch

from spin_cluster.kernels.page_select import (
    label_append,
    label_append_ref,
    label_block_pages,
    label_query,
    label_query_ref,
    label_scores,
    label_scores_ref,
)
from spin_cluster.sparse import get_algorithm


def _labels(channels=8, P=4, S=4, Hkv=2, D=8, R=2, model_path=None, index_dtype="float32"):
    return get_algorithm("labels")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=R,
                                   max_pages_per_seq=P, device=torch.device("cpu"), channels=channels,
                                   model_path=model_path, index_dtype=index_dtype)


def _best_key_of_each_page(k, q, h):
    """[4] KV head h's best q.k of each page of 4 keys (``one_row``'s 2 query heads a KV head)."""
    per_key = (q[0, 2 * h : 2 * h + 2] @ k[:, h].T).sum(0)
    return torch.stack([per_key[4 * p : 4 * p + 4].max() for p in range(4)])


def test_all_channels_score_each_page_by_its_best_key(one_row):
    alg = _labels()
    k, q = one_row(alg)  # 13 keys in row 1, G = 2
    scores = alg.score(0, q, torch.tensor([1]), 4)
    for h in range(2):
        torch.testing.assert_close(scores[0, h], _best_key_of_each_page(k, q, h), rtol=1e-5, atol=1e-5)


def test_a_new_request_in_a_row_forgets_the_old_tokens():
    alg = _labels()
    alg.on_append(0, torch.zeros(16, dtype=torch.long), torch.arange(16), torch.full((16, 2, 8), 9.0))
    alg.on_append(0, torch.zeros(5, dtype=torch.long), torch.arange(5), torch.ones(5, 2, 8))
    scores = alg.score(0, torch.ones(1, 4, 8), torch.tensor([0]), 4)
    assert torch.isinf(scores[..., 2:]).all() and (scores[..., 2:] < 0).all()  # nothing written there now
    assert (scores[..., :2] == 16.0).all()  # 2 query heads x 8 channels of ones


def test_without_weights_the_channels_are_evenly_spaced_rope_pairs():
    alg = _labels(channels=4)
    assert alg.channel_ids[0, 0].tolist() == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="channels"):
        _labels(channels=3)


def test_append_and_score_never_synchronise(op_log):
    alg = _labels(channels=4)
    rows, positions, k, q = torch.tensor([0, 1]), torch.tensor([3, 0]), torch.randn(2, 2, 8), torch.randn(2, 4, 8)
    with op_log() as log:
        plan = alg.plan_append(rows, positions)
        alg.append(0, plan, k)
        alg.score(0, q, rows, 4)
    assert not log.syncs(), log.syncs()


@pytest.mark.parametrize("S,rc,Hkv,dtype,tile", [(4, 8, 2, torch.float32, 8192), (16, 6, 2, torch.float32, 8192),
                                                  (2, 4, 2, torch.float32, 8192), (4, 8, 2, torch.float8_e4m3fn, 8192),
                                                  (4, 6, 3, torch.float32, 64), (8, 4, 1, torch.bfloat16, 32)])
def test_triton_scorer_equals_reference(S, rc, Hkv, dtype, tile):
    # tile: values a program reads (64 and 32: blocks of 1 and 2 pages with every head; 8192: the
    # whole row); Hkv 3 pads its heads to 4, r = 6 its channels to 8.
    g = torch.Generator().manual_seed(S + rc)
    B, R, P = 3, 4, 5
    span = P * S
    labels = torch.randn(R * span + 1, Hkv, rc, generator=g).to(dtype)
    qr = torch.randn(B, Hkv, rc, generator=g)
    rows = torch.tensor([2, 0, 3])
    lengths = torch.tensor([7, span, 1, 3 * S + 1, 0])  # rows 0..3 and the dump row
    for num_pages in (P, 2):
        want = label_scores_ref(qr, labels, rows, lengths, span, num_pages, S)
        got = label_scores(qr, labels, rows, lengths, span, num_pages, S, impl="triton", tile_values=tile)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        held = torch.rand(B, Hkv, num_pages, generator=g) < 0.5  # the hysteresis, in the same launch
        got = label_scores(qr, labels, rows, lengths, span, num_pages, S, held, 2.5, impl="triton", tile_values=tile)
        torch.testing.assert_close(got, want + 2.5 * held, rtol=1e-5, atol=1e-5)
    empty = [p for p in range(2) if p * S >= 7]  # row 0 wrote 7 tokens: later pages hold none
    assert torch.isinf(want[1, :, empty]).all() and torch.isfinite(want[0, :, 0]).all()


def test_select_top_takes_the_pages_of_the_separate_steps():
    """``select_top`` (the margin in the scoring launch, forced on the CPU) against the scores,
    the margin added and ``select_pages``: page for page, per-head budgets, a short row."""
    from spin_cluster.sparse import SelectPlan, select_layer

    g = torch.Generator().manual_seed(5)
    alg = _labels(P=6, S=4, R=3)
    alg.on_append(0, torch.tensor([0] * 24 + [2] * 13), torch.cat([torch.arange(24), torch.arange(13)]),
                  torch.randn(37, 2, 8, generator=g))
    q, rows = torch.randn(2, 4, 8, generator=g), torch.tensor([0, 2])
    plan = SelectPlan(num_pages=torch.tensor([6, 4]), tail_len=torch.tensor([4, 1], dtype=torch.int32),
                      sink_pages=1, local_pages=1, budget_pages=torch.tensor([[2, 1], [1, 3]]), max_pages=6,
                      max_budget=3)
    held = torch.rand(2, 2, 6, generator=g) < 0.5
    with pytest.raises(ValueError, match="held must be"):
        alg.score(0, q, rows, 6, held[..., :5], 1.0)
    assert alg.select_top(0, q, rows, plan, held, 1.0) is None  # on the CPU: the separate steps
    for margin in (0.0, 0.7, 50.0):
        old = select_layer(alg, 0, q, rows, plan, held, margin, fused=False)
        new = select_layer(alg, 0, q, rows, plan, held, margin, fused=True)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


def test_scoring_blocks_hold_about_the_tile_in_whole_pages():
    assert label_block_pages(32, 8, 32) == 1  # Llama-3.1-8B at r = D/4: a page of 8 KiB in e4m3
    assert label_block_pages(16, 1, 64) == 8  # Gemma-3-270M
    assert label_block_pages(16, 3, 6, tile_values=64) == 1 and label_block_pages(4, 3, 6, tile_values=256) == 2
    assert label_block_pages(64, 16, 64) == 1  # a page past the tile: still one


@pytest.mark.parametrize("options", [{}, {"index_dtype": "float8_e4m3fn", "channels": 0.5}])
def test_a_whole_context_budget_gives_the_dense_tokens(offloaded_tokens, dense_tokens, options):
    engine, tokens = offloaded_tokens({"algorithm": "labels", "budget": 256, "options": options})
    assert tokens == dense_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rc,S,P,dtype", [(32, 32, 1024, torch.bfloat16), (64, 16, 2048, torch.float8_e4m3fn)])
def test_triton_scorer_equals_reference_at_llama_shapes(rc, S, P, dtype):
    """4 requests x 8 KV heads, 32K tokens: pages of 32 and 32 label channels in bf16, and
    pages of 16 and 64 channels in float8_e4m3fn."""
    g = torch.Generator().manual_seed(rc)
    B, Hkv = 4, 8
    span = P * S
    labels = torch.randn(B * span + 1, Hkv, rc, generator=g).to(dtype).cuda()
    qr = torch.randn(B, Hkv, rc, generator=g).cuda()
    rows = torch.tensor([3, 1, 0, 2]).cuda()
    lengths = torch.tensor([span, span - 5, 100, 7 * S, 0]).cuda()
    got = label_scores(qr, labels, rows, lengths, span, P, S, impl="triton")
    torch.testing.assert_close(got, label_scores_ref(qr, labels, rows, lengths, span, P, S), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("H,Hkv,D,rc", [(32, 8, 128, 32), (12, 2, 128, 32), (4, 1, 256, 64)])
def test_triton_query_equals_reference_at_model_shapes(H, Hkv, D, rc):
    """Llama-3.1-8B (G = 4), Qwen2.5-1.5B (G = 6) and Gemma-3-270M (G = 4) queries, bf16 Q of
    a fused QKV output, 48 requests: the same float32 values as the torch sum and gather."""
    g = torch.Generator().manual_seed(H)
    ids = torch.stack([torch.randperm(D, generator=g)[:rc] for _ in range(Hkv)]).cuda()
    # Multiples of 1/64 under 2^9: every sum of their heads is exact in float32, in any order.
    qkv = (torch.randn(48, H + 2 * Hkv, D, generator=g) * 64).round().div(64).to(torch.bfloat16).cuda()
    assert torch.equal(label_query(qkv[:, :H], ids, impl="triton"), label_query_ref(qkv[:, :H], ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_triton_append_equals_reference_at_llama_shapes(dtype):
    """A decode step's and a prefill chunk's keys (bf16, the K of a fused QKV output) into
    labels of 32 channels of 8 KV heads: the same bytes as the reference."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(128, generator=g)[:32] for _ in range(8)]).cuda()
    for T in (4, 2048):
        qkv = (torch.randn(T, 48, 128, generator=g) * 64).to(torch.bfloat16).cuda()
        k = qkv[:, 32:40]
        slots = torch.randperm(4096, generator=g)[:T].cuda()
        got, want = (torch.zeros(4097, 8, 32, dtype=dtype, device="cuda") for _ in range(2))
        label_append(got, k, ids, slots, impl="triton")
        label_append_ref(want, k, ids, slots)
        assert torch.equal(got.view(torch.uint8) if dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if dtype == torch.float8_e4m3fn else want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 4])
def test_select_top_equals_the_separate_steps_on_gpu(B):
    """Llama-3.1-8B shapes at 32K, e4m3 labels, S-HPLB budgets, the margin: ``select_layer``
    with the margin in the scoring launch and without, page for page, eager and in a graph."""
    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.sparse import SelectPlan, select_layer

    dev = torch.device("cuda")
    hkv, H, D, S, T = 8, 32, 128, 32, 32768
    P = T // S
    alg = get_algorithm("labels")(num_layers=1, num_kv_heads=hkv, head_dim=D, page_size=S, max_seqs=B,
                                  max_pages_per_seq=P, device=dev, index_dtype="float8_e4m3fn")
    g = torch.Generator(device=dev).manual_seed(2)
    for b in range(B):
        alg.on_append(0, torch.full((T,), b, device=dev), torch.arange(T, device=dev),
                      torch.randn(T, hkv, D, device=dev, generator=g).to(torch.bfloat16))
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    rows = torch.arange(B, device=dev).flip(0)
    budgets = -(-torch.tensor(synthetic_maxmin_budgets(B, hkv, 2048, S), device=dev) // S)
    plan = SelectPlan(num_pages=torch.full((B,), P, device=dev), tail_len=torch.full((B,), S, dtype=torch.int32,
                      device=dev), sink_pages=1, local_pages=2, budget_pages=budgets, max_pages=P,
                      max_budget=int(budgets.max()))
    held = torch.rand(B, hkv, P, device=dev, generator=g) < 0.2
    old = select_layer(alg, 0, q, rows, plan, held, 0.5, fused=False)
    new = select_layer(alg, 0, q, rows, plan, held, 0.5)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_layer(alg, 0, q, rows, plan, held, 0.5)
    graph.replay()
    assert torch.equal(out[0], old[0]) and torch.equal(out[1], old[1])


def test_a_fraction_of_the_head_dim_picks_that_share_of_channels():
    assert _labels(channels=0.5).channels == 4  # D = 8
    assert _labels(channels=0.25).channels == 2
    assert _labels(channels=0).channels == 2
    with pytest.raises(ValueError, match="channels"):
        _labels(channels=2.5)


def test_an_fp8_index_scores_as_the_keys_rounded_to_fp8(one_row):
    alg = _labels(index_dtype="float8_e4m3fn")
    assert alg.labels.dtype == torch.float8_e4m3fn and alg.index_bytes_per_token() == 2 * 8
    k, q = one_row(alg)
    scores = alg.score(0, q, torch.tensor([1]), 4)
    k8 = k.to(torch.float8_e4m3fn).float()
    for h in range(2):
        torch.testing.assert_close(scores[0, h], _best_key_of_each_page(k8, q, h), rtol=1e-5, atol=1e-5)


def test_an_fp8_index_clamps_keys_past_its_range():
    alg = _labels(index_dtype="float8_e4m3fn")
    k = torch.full((4, 2, 8), 1e4)
    k[1] = -1e4
    alg.on_append(0, torch.zeros(4, dtype=torch.long), torch.arange(4), k)
    held = alg.labels[0, :4].float()
    assert torch.isfinite(held).all() and held.abs().max() == 448.0
    assert torch.isfinite(alg.score(0, torch.ones(1, 4, 8), torch.tensor([0]), 1)).all()


def test_only_labels_takes_an_fp8_index():
    with pytest.raises(ValueError, match="quest takes one of"):
        get_algorithm("quest")(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, max_seqs=2,
                               max_pages_per_seq=4, device=torch.device("cpu"), index_dtype="float8_e4m3fn")

