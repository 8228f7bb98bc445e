"""Gemma 3 on the offloaded cache: the hybrid cache (``kvcache/hybrid.py``) serves the
sliding-window layers from paged GPU pages and only the full-attention layers through Spin.

A tiny random Gemma 3 of six layers, two of them full attention (layers 2 and 5), window 16,
pages of 4 tokens, on the CPU in float32:

* with the dense oracle (every page selected) its greedy tokens equal the paged cache's, for
  prompts shorter and longer than the window, in chunks and decoded together, with every
  page at home on the host (the GPU buffer retrieves each) or on the GPU;
* with Quest at a budget of 8 tokens it runs, its algorithm, index and buffer are sized for
  the two global layers and its Select runs on them only, and per-head budgets take the
  global layers' rows; Labels ranks the channels of those layers' weights; block-sparse
  prefill runs on them only;
* after requests finish, are aborted mid-prefill and mid-decode, both parts have every page back.
"""

from __future__ import annotations

import random

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.cache_builder import cache_kind
from spin_cluster.engine.cuda_graphs import DecodeGraphs, SpinDecodeGraphs
from spin_cluster.kvcache.buffer_policy import BufferPolicy
from spin_cluster.models.config import ModelConfig
from spin_cluster.profiling.evaluate import EvalConfig, evaluate
from spin_cluster.sparse.channels import weight_channels

LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention")
WINDOW = 16
GLOBAL_LAYERS = (2, 5)
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SMALL_SEGMENTS = BufferPolicy(segment_pages=4)  # a tiny Gemma's cache: segments of 16 tokens


@pytest.fixture(scope="module")
def gemma_path(tiny_gemma3):
    return tiny_gemma3.save(tiny_gemma3.config(layer_types=LAYER_TYPES, window=WINDOW), "gemma-two-global")


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


# 5 tokens: inside the window; 40 and 70: past it in prefill (in chunks of 32), and in decode
PROMPTS = [_ids(5, 1), _ids(40, 2), _ids(70, 3)]


def _engine(path: str, cache: dict | None = None, sparse: dict | None = None) -> Engine:
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"page_size": 4, **(cache or {})},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32},
        "sparse": sparse or {},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=SMALL_SEGMENTS)


def _generate(engine: Engine) -> list[list[int]]:
    """Greedy tokens of PROMPTS, stepped one at a time with the cache checked after each step."""
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_integrity()
        _check_window_pages(engine)
    _check_all_pages_back(engine)
    return [got[rid] for rid in ids]


def _check_window_pages(engine: Engine) -> None:
    """The paged part holds at most a window's pages (+1 for the page edge) per window layer."""
    paged = engine.kv.paged
    for rid in paged.request_ids():
        assert max(paged.num_layer_pages(rid)) <= 2 * (-(-WINDOW // 4) + 1)


def _check_all_pages_back(engine: Engine) -> None:
    kv = engine.kv
    kv.check_integrity()
    assert kv.request_ids() == [] and kv.paged.request_ids() == []
    assert kv.paged.num_free_pages == kv.paged.num_total_pages
    assert kv.spin.num_free_pages == kv.spin.num_total_pages
    assert kv.buffer.num_free_slots == kv.buffer.num_slots


def test_only_models_with_window_layers_get_the_hybrid_cache(gemma_path, tiny_llama_path):
    offload = SpinConfig.from_dict({"cache": {"kind": "offloaded"}})
    assert cache_kind(offload, ModelConfig.from_folder(gemma_path)) == "hybrid"
    assert cache_kind(offload, ModelConfig.from_folder(tiny_llama_path)) == "offloaded"
    assert cache_kind(SpinConfig(), ModelConfig.from_folder(gemma_path)) == "paged"


@pytest.fixture(scope="module")
def paged_tokens(gemma_path):
    return _generate_paged(_engine(gemma_path))


def _generate_paged(engine: Engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, PARAMS)
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("gpu_home_fraction", [0.0, None], ids=["host-homes", "gpu-homes"])
def test_dense_on_the_offloaded_cache_gives_the_paged_cache_tokens(gemma_path, paged_tokens, gpu_home_fraction):
    engine = _engine(gemma_path, cache={"kind": "offloaded", "gpu_home_fraction": gpu_home_fraction},
                     sparse={"algorithm": "dense"})
    assert engine.kv.attention_backend == "hybrid"
    assert (engine.kv.split.window_layers, engine.kv.split.global_layers) == ((0, 1, 3, 4), GLOBAL_LAYERS)
    assert all(len(t) == PARAMS.max_tokens for t in paged_tokens)
    assert _generate(engine) == paged_tokens
    if gpu_home_fraction == 0.0:  # every global page came from the host through the buffer
        assert engine.kv.buffer.counters.tolist()[2] > 0


def test_quest_runs_on_the_global_layers_only(gemma_path):
    budgets = [[8 * (layer + 1), 4 * (layer + 1)] for layer in range(len(LAYER_TYPES))]
    engine = _engine(gemma_path, cache={"kind": "offloaded", "gpu_home_fraction": 0.0},
                     sparse={"algorithm": "quest", "budget": 8, "budget_floor_tokens": 0, "sink_tokens": 4,
                             "local_tokens": 4, "options": {"per_head_budgets": budgets}})
    kv, attention = engine.kv, engine.runner.attention
    assert kv.spin.num_layers == 2 and kv.paged.num_layers == 4 and kv.num_layers == len(LAYER_TYPES)
    assert attention.algorithm.num_layers == 2 and attention.algorithm.kmin.shape[0] == 2
    assert attention.algorithm.model_layers == GLOBAL_LAYERS
    assert kv.spin.directory.directory.shape[1] == 2
    # the global layers' rows of the per-head budgets, in pages of 4 tokens
    assert attention.spin._layer_budgets.tolist() == [[6, 3], [12, 6]]
    layers = []
    append = attention.algorithm.append
    attention.algorithm.append = lambda layer, *a: layers.append(layer) or append(layer, *a)
    tokens = _generate(engine)
    assert [len(t) for t in tokens] == [PARAMS.max_tokens] * len(PROMPTS)
    assert set(layers) == {0, 1}
    lookups, hits, misses, _ = kv.buffer.counters.tolist()
    assert lookups > 0 and misses > 0


def test_labels_rank_the_channels_of_the_global_layers_weights(gemma_path):
    engine = _engine(gemma_path, cache={"kind": "offloaded"}, sparse={"algorithm": "labels", "budget": 8,
                                                                  "budget_floor_tokens": 0})
    algorithm = engine.runner.attention.algorithm
    want = weight_channels(gemma_path, GLOBAL_LAYERS, 2, 32, algorithm.channels)
    assert torch.equal(algorithm.channel_ids.cpu(), want)
    assert not torch.equal(want, weight_channels(gemma_path, (0, 1), 2, 32, algorithm.channels))
    assert [len(t) for t in _generate(engine)] == [PARAMS.max_tokens] * len(PROMPTS)


def test_block_sparse_prefill_runs_on_the_global_layers_only(gemma_path):
    """Window layers prefill densely (block-sparse prefill cannot mask a window); the global
    layers' prefill goes through the blocks, under the model's layer ids."""
    engine = _engine(gemma_path, cache={"kind": "offloaded"}, sparse={
        "algorithm": "dense", "prefill": {"algorithm": "block", "options": {"block_size": 16, "budget": 0.5}}})
    prefill = engine.runner.attention.sparse_prefill
    seen = []
    call = prefill.inner.__call__
    prefill.inner = lambda layer, *a: seen.append(layer) or call(layer, *a)
    prefill.inner.density = call.__self__.density
    assert [len(t) for t in _generate(engine)] == [PARAMS.max_tokens] * len(PROMPTS)
    assert set(seen) == set(GLOBAL_LAYERS)
    assert 0.0 < prefill.density() <= 1.0


def test_aborts_give_every_page_back_in_both_parts(gemma_path):
    engine = _engine(gemma_path, cache={"kind": "offloaded"}, sparse={"algorithm": "quest", "budget": 8,
                                                                  "budget_floor_tokens": 0})
    kv = engine.kv
    start = (kv.paged.num_free_pages, kv.spin.num_free_pages, kv.buffer.num_free_slots)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in PROMPTS]
    engine.step()  # the 70-token prompt is still in prefill: its first chunk is done
    engine.abort(ids[2])
    engine.check_integrity()
    for _ in range(5):
        engine.step()
    engine.abort(ids[1])  # mid-decode
    engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    _check_all_pages_back(engine)
    assert (kv.paged.num_free_pages, kv.spin.num_free_pages, kv.buffer.num_free_slots) == start


def test_a_sparse_eval_runs_on_gemma(gemma_path):
    """``spin-cluster eval``'s run: dense on the paged cache, Quest on the hybrid one."""
    cfg = EvalConfig(base={"model": {"path": gemma_path, "device": "cpu"}}, tasks=("niah_single",), lengths=(160,),
                     samples_per_task=1, algorithms=("dense", "quest"), budgets=(0.25,), max_tokens=8)
    res = evaluate(cfg, progress=False)
    assert [m.label for m in res.methods] == ["dense", "quest 1/4"]
    assert len(res.samples) == 2 and all(0.0 <= s.score <= 1.0 for s in res.samples)
    looked = res.buffer_lookups["quest 1/4@160"]
    assert looked["hits"] + looked["misses"] > 0


def _generate_static(engine: Engine, capture: bool = False):
    """``_generate`` with decode-only steps on ``SpinDecodeGraphs``'s static path (the plan built
    from device tensors, as a CUDA graph runs it); capture=False runs it eagerly (the CPU)."""
    graphs = engine.runner.graphs
    if not capture:
        graphs = engine.runner.graphs = SpinDecodeGraphs(engine.model, engine.runner.attention, max_batch=4,
                                                         capture=False)
    batches = []
    forward = graphs._forward
    graphs._forward = lambda B, P: batches.append(B) or forward(B, P)
    return _generate(engine), graphs, batches


@pytest.mark.parametrize("algorithm", ["dense", "quest"])
def test_the_static_decode_path_gives_the_plain_path_tokens(gemma_path, algorithm):
    """Decode steps planned on the device (the Spin part's plan and the window layers' pages,
    ``PagedAttention.decode_plan``) give the eagerly planned steps' tokens, counters and pages."""
    cache = {"kind": "offloaded", "gpu_home_fraction": 0.0}
    sparse = {"algorithm": algorithm, "budget": 8, "budget_floor_tokens": 0, "sink_tokens": 4, "local_tokens": 4}
    plain = _engine(gemma_path, cache=cache, sparse=sparse)
    assert plain.runner.graphs is None  # the CPU: no graphs
    want = _generate(plain)
    engine = _engine(gemma_path, cache=cache, sparse=sparse)
    tokens, graphs, batches = _generate_static(engine)
    assert tokens == want
    assert engine.kv.buffer.counters.tolist() == plain.kv.buffer.counters.tolist()
    assert set(batches) >= {1, 2, 3} and graphs.num_graphs == 0  # every batch size took the static path


def test_window_pages_come_from_the_window_only(gemma_path):
    """The window layers' decode plan lists, per row, the pages its window can touch (the
    scratch page past the row's end) and keeps exactly the window's slots."""
    engine = _engine(gemma_path, cache={"kind": "offloaded"}, sparse={"algorithm": "dense"})
    attention = engine.runner.attention
    rid = engine.add_request(_ids(70, 9), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(3):  # the prompt in chunks of 32, 32 and 6 tokens
        engine.step()
    (request,) = engine.scheduler.running
    n = request.num_computed_tokens  # the next position: 70
    assert n == 70
    paged, S = attention.paged, engine.kv.page_size
    row = engine.kv.paged.table.row(rid)
    positions = torch.tensor([n, 3])  # a long row, and a row inside its first page
    paged.plan = paged.decode_plan(positions, torch.tensor([row, row]))
    wp = paged._window_plan(WINDOW)
    W = (WINDOW - 1) // S + 2
    assert wp.ids.shape == (4, 2, engine.kv.num_kv_heads, W) and wp.keep.shape == (2, W * S)
    first = (n + 1 - WINDOW) // S  # the page of the window's first key
    table = engine.kv.paged.table.table[row]  # [L, Hkv, P]
    for j in range(W):
        want = table[:, :, first + j] if (first + j) * S <= n else torch.full_like(table[:, :, 0], paged.pool.scratch_page_id)
        assert torch.equal(wp.ids[:, 0, :, j].long(), want.long())
    kept = [first * S + t for t in range(W * S) if wp.keep[0, t]]
    assert kept == list(range(n + 1 - WINDOW, n + 1))
    assert [t for t in range(W * S) if wp.keep[1, t]] == [0, 1, 2, 3]  # positions 0 .. 3 of page 0
    assert (wp.ids[:, 1, :, 1:] == paged.pool.scratch_page_id).all()
    assert wp.lens is None and wp.starts is None  # the SDPA path's plan: its mask only
    # the kernel's plan (CUDA): lengths and first keys from each row's first window page, no mask
    paged._window_kernel = True
    kp = paged._window_plan(WINDOW)
    paged._window_kernel = False
    assert torch.equal(kp.ids, wp.ids) and kp.keep is None
    assert kp.lens.tolist() == [n + 1 - first * S, 4] and kp.starts.tolist() == [n + 1 - WINDOW - first * S, 0]
    paged.plan = None
    engine.abort(rid)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["dense", "quest", "paged"])
def test_hybrid_decode_graphs_give_the_eager_tokens(gemma_path, algorithm):
    """The hybrid cache's graphs (``SpinDecodeGraphs``), and the paged cache's (``DecodeGraphs``:
    its window plan built inside each captured graph), give the eager steps' tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = {"cache": {"kind": "offloaded", "gpu_home_fraction": 0.0},
           "sparse": {"algorithm": algorithm, "budget": 8, "budget_floor_tokens": 0, "sink_tokens": 4,
                      "local_tokens": 4}}
    if algorithm == "paged":
        cfg = {"cache": {"kind": "paged"}, "sparse": {}}

    def engine(graphs: bool) -> Engine:
        c = {"model": {"path": gemma_path, "device": "cuda", "dtype": "float32", "max_model_len": 256,
                       "cuda_graphs": graphs},
             "cache": {"page_size": 4, **cfg["cache"]},
             "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32}, "sparse": cfg["sparse"]}
        return Engine(SpinConfig.from_dict(c), progress=False, buffer_policy=SMALL_SEGMENTS)

    eager, captured = engine(False), engine(True)
    assert eager.runner.graphs is None
    if algorithm == "paged":
        assert isinstance(captured.runner.graphs, DecodeGraphs)
        want = [o.token_ids for o in eager.generate(PROMPTS, PARAMS)]
        assert [o.token_ids for o in captured.generate(PROMPTS, PARAMS)] == want
        return
    want = _generate(eager)
    assert isinstance(captured.runner.graphs, SpinDecodeGraphs)
    tokens, graphs, _ = _generate_static(captured, capture=True)
    assert tokens == want
    assert graphs.captures >= 1 and graphs.replays >= 5, (graphs.captures, graphs.replays)


def test_window_layers_on_the_decode_kernel_give_the_gathered_path_tokens(gemma_path, paged_tokens):
    """The window layers' decode through the Triton kernel (as on CUDA; the interpreter here),
    reading each row's window in place from its first key, gives the gather-and-SDPA path's
    tokens: the paged cache's, with the dense oracle on the hybrid one."""
    for cache, sparse in (({}, None), ({"kind": "offloaded", "gpu_home_fraction": 0.0}, {"algorithm": "dense"})):
        engine = _engine(gemma_path, cache=cache, sparse=sparse)
        paged = engine.runner.attention if not cache else engine.runner.attention.paged
        paged._window_kernel = True
        calls = []
        window_plan = paged._window_plan
        paged._window_plan = lambda w: calls.append(w) or window_plan(w)
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == paged_tokens
        assert calls and set(calls) == {WINDOW}


def test_two_level_quest_keeps_its_group_bounds_in_step(gemma_path):
    """Quest's two-level Select on the global layers: prefill chunks refresh the group bounds
    they touch, decode steps leave each request's last group to the Select; after a run every
    group's bounds are exactly its pages' (the min and max over them)."""
    engine = _engine(gemma_path, cache={"kind": "offloaded"},
                     sparse={"algorithm": "quest", "budget": 8, "budget_floor_tokens": 0, "sink_tokens": 4,
                             "local_tokens": 4, "options": {"coarse_pages": 2, "coarse_factor": 1}})
    alg = engine.runner.attention.algorithm
    tokens = _generate(engine)
    assert [len(t) for t in tokens] == [PARAMS.max_tokens] * len(PROMPTS)
    L, N, H, D = alg.kmin.shape
    pages = alg.kmin[:, :-1].view(L, (N - 1) // 2, 2, H, D)
    assert torch.equal(alg.cmin[:, :-1], pages.amin(2))
    assert torch.equal(alg.cmax[:, :-1], alg.kmax[:, :-1].view(L, (N - 1) // 2, 2, H, D).amax(2))
    assert torch.isfinite(alg.cmin[:, :-1]).any()
