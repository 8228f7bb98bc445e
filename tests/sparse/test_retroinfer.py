import pytest
import torch

from spin_cluster.sparse import get_algorithm, register
from spin_cluster.sparse.retroinfer import RetroInfer, kmeans



@register
class _SmallSegments(RetroInfer):
    """Segments of 2 pages so that the engine test's short requests complete some."""

    name = "_test_retroinfer_small"
    segment_pages = 2
    num_clusters = 3


def _alg(R=2, P=16, S=4, Hkv=2, D=8, segment_pages=4, num_clusters=4):
    return get_algorithm("retroinfer")(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=R,
                                       max_pages_per_seq=P, device=torch.device("cpu"), segment_pages=segment_pages,
                                       num_clusters=num_clusters, buffer_dtype=torch.float32)


def _append(alg, row, k, start=0):
    T = k.shape[0]
    alg.on_append(0, torch.full((T,), row), torch.arange(start, start + T), k)


def test_kmeans_centroids_are_their_members_means_and_separated_blobs_are_found():
    g = torch.Generator().manual_seed(0)
    centers = 10 * torch.randn(3, 8, generator=g)
    x = (centers[torch.arange(24) % 3] + 0.1 * torch.randn(24, 8, generator=g))[None]  # [1, 24, 8]
    cent, assign = kmeans(x, 3, iters=3)
    assert (assign[0] == assign[0, :3][torch.arange(24) % 3]).all()  # one cluster per blob
    for c in range(3):
        assert torch.allclose(cent[0, c], x[0, assign[0] == c].mean(0), atol=1e-5)


def test_score_shape_clustered_pages_finite_and_the_open_segment_infinite():
    g = torch.Generator().manual_seed(1)
    alg = _alg()  # segments of 4 pages = 16 tokens
    _append(alg, 1, torch.randn(38, 2, 8, generator=g))  # segments 0, 1 complete; 2 open
    q = torch.randn(3, 4, 8, generator=g)
    scores = alg.score(0, q, torch.tensor([1, 1, 1]), 10)
    assert scores.shape == (3, 2, 10)
    assert scores[..., :8].isfinite().all() and (scores[..., 8:] == float("inf")).all()
    assert torch.equal(scores, alg.score(0, q, torch.tensor([1, 1, 1]), 10))  # deterministic


def test_the_page_holding_a_planted_key_ranks_first():
    g = torch.Generator().manual_seed(2)
    alg = _alg()
    q = torch.randn(1, 4, 8, generator=g)
    k = 0.1 * torch.randn(48, 2, 8, generator=g)
    k[22, 1] = 5 * q[0, 2:4].sum(0)  # page 5 (segment 1) of KV head 1
    _append(alg, 0, k)
    scores = alg.score(0, q, torch.tensor([0]), 12)
    assert scores[0, 1].argmax().item() == 5


def _reference(R, k_rows, P=16):
    ref = _alg(R=R, P=P)
    for r, k in enumerate(k_rows):
        _append(ref, r, k)
    return ref


def test_chunks_and_decode_tokens_in_lockstep_build_the_index_of_one_append():
    g = torch.Generator().manual_seed(3)
    R, T = 8, 70  # 8 rows finish a segment in the same decode call; 3 clustering slots a call
    k = torch.randn(R, T, 2, 8, generator=g)
    alg = _alg(R=R, P=20)
    assert alg.pending_slots == 3
    for r in range(R):  # prefill 5 tokens per row, then decode all rows together
        _append(alg, r, k[r, :5])
    for t in range(5, T):
        alg.on_append(0, torch.arange(R), torch.full((R,), t), k[:, t])
    ref = _reference(R, k, P=20)
    q = torch.randn(R, 4, 8, generator=g)
    rows = torch.arange(R)
    assert alg.lost_segments.item() == 0
    assert torch.allclose(alg.score(0, q, rows, 16), ref.score(0, q, rows, 16), atol=1e-4)


def test_a_chunk_that_runs_past_a_waiting_segment_clusters_it_first():
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 64, 2, 8, generator=g)
    alg = _alg(R=1)
    # chunk ends exactly at segment 0's end (segment 0 waits in the ring) ... then a chunk of 3
    # segments, whose writes reuse segment 0's ring half.
    for lo, hi in ((0, 16), (16, 60), (60, 64)):
        _append(alg, 0, k[0, lo:hi], lo)
    ref = _reference(1, k)
    q = torch.randn(1, 4, 8, generator=g)
    assert alg.lost_segments.item() == 0 and alg.ready[0, :4].all()
    assert torch.allclose(alg.score(0, q, torch.tensor([0]), 16), ref.score(0, q, torch.tensor([0]), 16), atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_of_chunks_and_decode_tokens_build_the_index_of_one_append(seed):
    import random

    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    R, N = 5, 90
    k = torch.randn(R, N, 2, 8, generator=g)
    alg, done = _alg(R=R, P=24), [0] * R
    while min(done) < N:  # a step: some rows, each one decode token or one chunk, in any row order
        rows, positions, keys = [], [], []
        for r in rnd.sample(range(R), rnd.randint(1, R)):
            n = min(N - done[r], 1 if rnd.random() < 0.5 else rnd.randint(1, 40))
            rows += [r] * n
            positions += range(done[r], done[r] + n)
            keys.append(k[r, done[r] : done[r] + n])
            done[r] += n
        if rows:
            alg.on_append(0, torch.tensor(rows), torch.tensor(positions), torch.cat(keys))
    ref = _reference(R, k, P=24)
    q, rows = torch.randn(R, 4, 8, generator=g), torch.arange(R)
    assert alg.lost_segments.item() == 0
    assert torch.allclose(alg.score(0, q, rows, 23), ref.score(0, q, rows, 23), atol=1e-4)


def test_a_reused_row_forgets_the_previous_request():
    g = torch.Generator().manual_seed(5)
    alg = _alg(R=1)
    _append(alg, 0, 100 * torch.randn(47, 2, 8, generator=g))  # old request: segment 2 nearly done
    k = torch.randn(20, 2, 8, generator=g)
    _append(alg, 0, k)
    assert not alg.pending[0, :2].any()
    scores = alg.score(0, torch.randn(1, 4, 8, generator=g), torch.tensor([0]), 5)
    assert scores[0, :, :4].isfinite().all() and (scores[0, :, 4] == float("inf")).all()
    fresh = _reference(1, [k])
    assert torch.equal(alg.centroids[0, 0], fresh.centroids[0, 0])


def test_index_and_select_run_the_same_ops_for_any_token_count_without_host_syncs(op_log):
    g = torch.Generator().manual_seed(6)
    logs = []
    for T, pages in ((6, 6), (40, 10)):  # no size-1 dims: einsum may take other paths for them
        alg = _alg()
        with op_log() as log:
            alg.on_append(0, torch.arange(T) // (T // 2), torch.arange(T) % (T // 2), torch.randn(T, 2, 8, generator=g))
            alg.score(0, torch.randn(2, 4, 8, generator=g), torch.arange(2), pages)
        assert log.syncs() == []
        logs.append(log.ops)
    assert logs[0] == logs[1]


def test_bad_cluster_count_names_the_limit():
    with pytest.raises(ValueError, match="num_clusters=20: use 1..16 "):
        _alg(segment_pages=4, num_clusters=20)


def test_retroinfer_with_the_whole_context_as_budget_equals_dense(offloaded_tokens, dense_tokens):
    sparse = {"algorithm": "_test_retroinfer_small", "budget": 256, "sink_tokens": 4, "local_tokens": 8}
    engine, tokens = offloaded_tokens(sparse)
    assert tokens == dense_tokens
    alg = engine.runner.attention.algorithm
    assert alg.ready[:, :-1].any() and alg.lost_segments.sum().item() == 0  # segments were clustered
