"""The Spin data path end to end on SmolLM2: offloaded pages, GPU buffer, Retrieve.

Most tests here exercise the buffer, so their cache keeps every page's home on the host
(``gpu_home_fraction: 0``) unless they say otherwise; the GPU home pages' own tests are at the
end."""

import pytest
import torch

from spin_cluster.algorithm_options import ScoredOptions
from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kvcache.buffer_policy import BufferPolicy
from spin_cluster.sparse.contract import SparseAlgorithm, register

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village, there lived",
    "List of prime numbers: 2, 3, 5, 7,",
]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@register
class _Scattered(SparseAlgorithm):
    """Test-only Select: pseudo-random page scores that change every step (no locality),
    so that the buffer evicts all the time."""

    name = "_test_scattered"
    options_model = ScoredOptions  # it scores pages: Select's options (resident_margin) apply
    _calls = 0

    def score(self, layer, q, rows, num_pages):
        _Scattered._calls += 1
        g = torch.Generator().manual_seed(_Scattered._calls)
        return torch.rand(q.shape[0], self.num_kv_heads, num_pages, generator=g).to(q.device)


def _engine(path, cache=None, sparse=None, max_len=256, **policy):
    """``policy``: ``BufferPolicy`` fields other than their defaults."""
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": max_len},
        "cache": {"page_size": 4, "gpu_home_fraction": 0.0, **(cache or {})},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "sparse": sparse or {},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=BufferPolicy(**policy))


def _quest_kv_gib(slots: int) -> float:
    """cache.kv_cache_gib of ``slots`` float32 buffer slots (pages of 4 tokens, D 64) with
    Quest's index inside it: float32 bounds, 512 B per page and head, of every page the
    tiers hold (the slots' and the host tier's: 8 rows x 64 pages x 90 heads)."""
    host_pages = 8 * 64 * 30 * 3
    return (slots * (2 * 4 * 64 * 4 + 512) + 512 * host_pages + 1024) / 2**30


def _run(engine, prompts=PROMPTS):
    outs = engine.generate(prompts, PARAMS)
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def gpu_only_tokens(smollm2_path):
    return _run(_engine(smollm2_path))


def test_dense_over_the_offloaded_cache_equals_the_gpu_only_cache(smollm2_path, gpu_only_tokens):
    eng = _engine(smollm2_path, cache={"kind": "offloaded"}, segment_pages=4)
    assert _run(eng) == gpu_only_tokens
    lookups, hits, misses, evicted = eng.kv.buffer.counters.tolist()
    assert lookups == hits + misses and hits > misses > 0 and evicted == 0
    st = eng.last_stats
    assert (st.buffer_lookups_total, st.buffer_hits_total) == (lookups, hits)
    assert st.retrieved_bytes_total == misses * 2 * 4 * 64 * 4  # K+V of a 4-token fp32 page, D=64
    meta = eng.kv.metadata_bytes()
    assert meta["flat_gpu"] == 4 * meta["gpu"]  # segments of 4 pages
    assert st.metadata_gpu_bytes == meta["gpu"] + meta["gpu_buffer"] and st.metadata_flat_gpu_bytes == meta["flat_gpu"]


@pytest.mark.parametrize("algorithm", ["streaming", "_test_scattered"])
def test_a_tight_buffer_gives_the_same_tokens_as_a_roomy_one(smollm2_path, algorithm):
    sparse = {"algorithm": algorithm, "budget": 16, "sink_tokens": 4, "local_tokens": 8}
    # mandatory = 1 sink + 4 budget + 2 local = 7 pages per head
    roomy = _engine(smollm2_path, cache={"kind": "offloaded"}, sparse=sparse, pages_per_head=64)
    tight = _engine(smollm2_path, cache={"kind": "offloaded"}, sparse=sparse, pages_per_head=7)
    _Scattered._calls = 0
    a = _run(roomy)
    _Scattered._calls = 0
    b = _run(tight)
    assert a == b
    ra, rb = roomy.kv.buffer.counters.tolist(), tight.kv.buffer.counters.tolist()
    assert ra[0] == rb[0]  # same selections
    assert rb[2] >= ra[2]  # the tight buffer misses at least as often
    if algorithm == "_test_scattered":
        assert rb[2] > ra[2]


def test_resident_margin_keeps_held_pages_against_near_ties(smollm2_path):
    """Scores that reshuffle every step (the worst case for the buffer): with a margin far
    above their spread a held page always wins, so Select keeps what the buffer holds and
    the hit ratio rises; the tokens stay valid and no slot leaks."""
    sparse = {"algorithm": "_test_scattered", "budget": 16, "sink_tokens": 4, "local_tokens": 8}
    hit_ratio = {}
    for margin in (0.0, 1e3):
        _Scattered._calls = 0
        eng = _engine(smollm2_path, cache={"kind": "offloaded"}, pages_per_head=8,
                      sparse={**sparse, "options": {"resident_margin": margin}})
        _run(eng)
        lookups, hits = eng.kv.buffer.counters.tolist()[:2]
        hit_ratio[margin] = hits / lookups
    assert hit_ratio[1e3] > hit_ratio[0.0] + 0.05, hit_ratio  # measured: 0.86 -> 0.95
    with pytest.raises(ValueError, match="resident_margin"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={**sparse, "options": {"resident_margin": -1}})


def test_buffer_resident_mask_lists_each_heads_held_pages(smollm2_path):
    eng = _engine(smollm2_path, cache={"kind": "offloaded"}, pages_per_head=14,
                  sparse={"algorithm": "streaming", "budget": 16, "sink_tokens": 4, "local_tokens": 8})
    ids = [eng.add_request(p, PARAMS) for p in PROMPTS[:2]]
    for _ in range(12):
        eng.step()
    buf = eng.kv.buffer
    rows = torch.tensor([eng.runner.attention.row(i) for i in ids])
    held = buf.resident(rows, 3, 40)  # [2, Hkv, 40]
    for b, row in enumerate(rows.tolist()):
        for h in range(buf.res_page.shape[2]):
            want = {p for p in buf.res_page[row, 3, h].tolist() if 0 <= p < 40}
            assert set(torch.nonzero(held[b, h]).flatten().tolist()) == want
    assert held.any()


def test_streaming_differs_from_dense_once_the_context_outgrows_the_window(smollm2_path, gpu_only_tokens):
    sparse = {"algorithm": "streaming", "budget": 16, "sink_tokens": 4, "local_tokens": 8}
    toks = _run(_engine(smollm2_path, cache={"kind": "offloaded"}, sparse=sparse))
    assert toks != gpu_only_tokens


def test_aborted_offloaded_requests_free_host_segments_and_buffer_slots(smollm2_path):
    eng = _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "streaming", "budget": 16})
    ids = [eng.add_request(p, PARAMS) for p in PROMPTS]
    for _ in range(4):
        eng.step()
    assert eng.kv.buffer.num_free_slots < eng.kv.buffer.num_slots
    for rid in ids:
        eng.abort(rid)
    eng.check_integrity()
    assert eng.kv.buffer.num_free_slots == eng.kv.buffer.num_slots
    assert eng.kv.num_free_pages == eng.kv.num_total_pages


def test_a_full_host_tier_makes_requests_wait_not_fail(smollm2_path, gpu_only_tokens):
    # 1 segment = 4 pages x 4 tokens = 16 tokens per (layer, head); 90 heads -> 2 requests' worth
    eng = _engine(smollm2_path, cache={"kind": "offloaded", "host_kv_gib": 90 * 8 * 4 * 2 * 4 * 64 * 4 / 2**30},
                  sparse={"algorithm": "dense"}, segment_pages=4)
    assert eng.kv.host.num_segments == 2 * 90 * 4
    assert _run(eng) == gpu_only_tokens  # requests queued and ran as space freed
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request(list(range(100, 240)))


def test_bad_sparse_config_names_the_fix(smollm2_path):
    with pytest.raises(ValueError, match="unknown sparse algorithm 'nope'"):
        _engine(smollm2_path, sparse={"algorithm": "nope"})
    with pytest.raises(ValueError, match="cache.kind=offloaded"):
        _engine(smollm2_path, sparse={"algorithm": "streaming", "budget": 16})
    with pytest.raises(ValueError, match="larger than the context"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "streaming", "budget": 1000})
    with pytest.raises(ValueError, match="must be > 0"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "streaming", "budget": 0})
    with pytest.raises(ValueError, match="sparse.options: 'shadowkv' takes no option 'nope'; its options: index_dtype, outlier_fraction"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "shadowkv", "budget": 16, "options": {"nope": 1}})
    with pytest.raises(ValueError, match="train-gate"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "seer", "budget": 16})
    with pytest.raises(ValueError, match=r"3 pages per head \(BufferPolicy.pages_per_head\) is below"):
        _engine(smollm2_path, cache={"kind": "offloaded"}, sparse={"algorithm": "streaming", "budget": 16}, pages_per_head=3)


def test_buffer_share_sizes_each_heads_share_as_a_multiple_of_the_selected_pages(smollm2_path):
    sparse = {"algorithm": "streaming", "budget": 16, "sink_tokens": 4, "local_tokens": 8}  # 1 + 4 + 2 pages of 4
    shares = {m: _engine(smollm2_path, cache={"kind": "offloaded", "buffer_share": m}, sparse=sparse).kv.buffer.max_share
              for m in (1, 2, 3.5)}
    assert shares == {1: 7, 2: 14, 3.5: 25}
    # 0 (the default): no cap below the request's pages (max_model_len 256 / page 4)
    assert _engine(smollm2_path, cache={"kind": "offloaded"}, sparse=sparse).kv.buffer.max_share == 64
    with pytest.raises(ValueError, match="buffer_share"):
        _engine(smollm2_path, cache={"kind": "offloaded", "buffer_share": 0.5}, sparse=sparse)


def test_quest_with_the_whole_context_as_budget_equals_dense(smollm2_path, gpu_only_tokens):
    sparse = {"algorithm": "quest", "budget": 256, "sink_tokens": 4, "local_tokens": 8}
    assert _run(_engine(smollm2_path, cache={"kind": "offloaded"}, sparse=sparse)) == gpu_only_tokens


def test_elastic_shares_run_more_requests_at_once(smollm2_path):
    sparse = {"algorithm": "quest", "budget": 16, "sink_tokens": 4, "local_tokens": 8}
    # mandatory 7 pages per head, max share 28; the buffer holds 4 x 28 columns per head
    gib = _quest_kv_gib(4 * 28 * 30 * 3)
    peak = {}
    for elastic in (True, False):
        eng = _engine(smollm2_path, cache={"kind": "offloaded", "kv_cache_gib": gib}, sparse=sparse,
                      pages_per_head=28, elastic_shares=elastic)
        for p in PROMPTS * 2:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        peak[elastic] = 0
        while eng.has_unfinished():
            eng.step()
            peak[elastic] = max(peak[elastic], eng.last_stats.num_running)
        eng.check_integrity()
    assert peak[False] == 4 and peak[True] == 8


def test_per_head_shares_fit_more_requests_with_the_same_tokens(smollm2_path):
    """BufferPolicy.per_head_shares with S-HPLB-style per-head budgets: each head's share is twice
    its own selection, not the widest head's, so one request takes fewer slots and the same
    GPU buffer runs more requests at once. Selection is unchanged, so are the tokens."""
    # SmolLM2: 30 layers x 3 KV heads; budgets of 8, 16 and 40 tokens (2, 4, 10 pages of 4)
    # plus 1 sink and 2 local pages: 5, 7 and 13 pages per step, full widths 10, 14, 26.
    sparse = {"algorithm": "quest", "budget": 16, "sink_tokens": 4, "local_tokens": 8,
              "options": {"per_head_budgets": [[8, 16, 40]] * 30}}
    uniform_slots = 26 * 30 * 3
    gib = _quest_kv_gib(3 * uniform_slots)  # three uniform full shares
    tokens, peak = {}, {}
    for per_head in (False, True, None):  # None: the policy's default, per-head shares
        cache = {"kind": "offloaded", "kv_cache_gib": gib, "buffer_share": 2}
        policy = {} if per_head is None else {"per_head_shares": per_head}
        eng = _engine(smollm2_path, cache=cache, sparse=sparse, **policy)
        b = eng.kv.buffer
        assert b.max_share == 26 and b.per_head_widths == (per_head is not False)
        if per_head is None:
            continue
        assert b.slots_for(26) == ((10 + 14 + 26) * 30 if per_head else uniform_slots)
        ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in PROMPTS * 2]
        out, peak[per_head] = {i: [] for i in ids}, 0
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id].extend(o.new_token_ids)
            peak[per_head] = max(peak[per_head], eng.last_stats.num_running)
            eng.check_integrity()
        assert b.num_free_slots == b.num_slots  # every share came back
        tokens[per_head] = [out[i] for i in ids]
    assert tokens[True] == tokens[False]
    assert peak[False] < peak[True] == 8, peak


# ---- pages at home on the GPU, spilled to the host when it is full ---------------------------


def test_gpu_home_pages_give_the_gpu_only_caches_tokens_without_a_transfer(smollm2_path, gpu_only_tokens):
    eng = _engine(smollm2_path, cache={"kind": "offloaded", "gpu_home_fraction": None}, segment_pages=4)
    assert eng.kv.homes.num_gpu_segments > 0
    assert _run(eng) == gpu_only_tokens
    lookups, hits, misses, evicted = eng.kv.buffer.counters.tolist()
    assert lookups == misses == 0  # every page read where it was born
    assert eng.kv.num_spilled_segments == 0


def test_forced_spilling_keeps_the_tokens_of_the_gpu_only_cache(smollm2_path, gpu_only_tokens):
    """A GPU home of 725 segments (16 tokens of one of 90 heads each: 8 logical segments) and a
    buffer for 3 requests' selections (dense selects a whole request: 64 pages x 90 heads) while
    3 requests of ~50 tokens need 3 x 3 logical segments: the GPU fills, the coldest segments
    move to the host, and decode reads them back through the buffer; the tokens do not change."""
    slot_bytes = 2 * 4 * 64 * 4  # K+V of a 4-token fp32 page, D=64
    eng = _engine(smollm2_path, cache={"kind": "offloaded", "gpu_home_fraction": 0.112,
                                       "kv_cache_gib": 25920 * slot_bytes / 2**30}, sparse={"algorithm": "dense"},
                  segment_pages=4)
    assert eng.kv.homes.num_gpu_segments == 725 and eng.kv.buffer.num_slots == 25920 - 2903
    assert _run(eng) == gpu_only_tokens
    lookups, hits, misses, evicted = eng.kv.buffer.counters.tolist()
    assert eng.kv.num_spilled_segments > 0 and misses > 0
    st = eng.last_stats
    assert st.spilled_pages_total == eng.kv.num_spilled_segments * 4


def test_a_cache_with_no_host_tier_holds_what_the_gpu_holds(smollm2_path, gpu_only_tokens):
    eng = _engine(smollm2_path, cache={"kind": "offloaded", "host_kv_gib": 0, "gpu_home_fraction": 0.5},
                  sparse={"algorithm": "dense"})
    assert eng.kv.host.num_segments == 0
    assert _run(eng) == gpu_only_tokens
    with pytest.raises(ValueError, match="no page a home"):
        _engine(smollm2_path, cache={"kind": "offloaded", "host_kv_gib": 0})


def test_fp8_host_pages_quarter_the_bytes_of_fp32_ones_and_keep_the_greedy_tokens(smollm2_path, gpu_only_tokens):
    """Every page's home on the host, as FP8 with per-row scales: a retrieved page moves
    2 x 4 x (64 + 4) bytes where float32 moves 2 x 4 x 64 x 4, and greedy decoding over the
    dequantised pages keeps the float32 tokens on all but a few positions."""
    eng = _engine(smollm2_path, cache={"kind": "offloaded", "host_kv_dtype": "fp8"},
                  sparse={"algorithm": "dense"}, segment_pages=4)
    assert eng.kv.host.k_pages.dtype == torch.float8_e4m3fn and eng.kv.host.page_bytes == 2 * 4 * (64 + 4)
    tokens = _run(eng)
    st = eng.last_stats
    assert st.buffer_misses_total > 0 and st.retrieved_bytes_total == st.buffer_misses_total * 2 * 4 * 68
    same = sum(a == b for x, y in zip(tokens, gpu_only_tokens) for a, b in zip(x, y))
    assert same >= 0.9 * sum(map(len, gpu_only_tokens)), (same, tokens, gpu_only_tokens)
