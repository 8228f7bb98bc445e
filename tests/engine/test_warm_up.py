"""``Engine.warm_up``: made-up prompts of every power-of-two length class before serving,
leaving no page held, no running total counted and no mark on what requests get."""

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams, warm_up

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "List of prime numbers: 2, 3, 5, 7,"]


def _engine(path, offload: bool) -> Engine:
    cache = {"page_size": 4, "kind": "offloaded" if offload else "paged"}
    if offload:  # Spin: a small GPU share, so that the longest warm-up prompt spills and misses
        cache.update(gpu_home_fraction=0.0, kv_cache_gib=0.002, host_kv_gib=0.05)
    sparse = {"algorithm": "quest", "budget": 16, "budget_floor_tokens": 0} if offload else {}
    return Engine(SpinConfig.from_dict({
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 200},
        "cache": cache, "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}, "sparse": sparse,
    }), progress=False)


@pytest.mark.parametrize("offload", [False, True], ids=["paged", "spin"])
def test_warm_up_leaves_the_engine_as_it_found_it(tiny_llama_path, offload, monkeypatch):
    want = [o.token_ids for o in _engine(tiny_llama_path, offload).generate(PROMPTS, PARAMS)]
    engine = _engine(tiny_llama_path, offload)
    monkeypatch.setattr(warm_up, "SHORTEST", 32)
    assert engine.warm_lengths() == [32, 64, 128, 196]  # powers of two, then the longest prompt
    assert engine.warm_up() == [32, 64, 128, 196]
    assert not engine.has_unfinished() and engine.kv.request_ids() == []
    assert engine.kv.num_free_pages == engine.kv.num_total_pages  # idle prefix-cache pages count as free
    engine.check_integrity()
    stats = engine._stats(0.0, 0, 0)
    assert stats.preemptions_total == 0 and stats.prefix_cache_queries_total == 0
    if offload:
        assert stats.buffer_lookups_total == 0 and stats.spilled_pages_total == 0
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want


def test_warm_up_skips_what_the_cache_cannot_hold_and_refuses_a_busy_engine(tiny_llama_path, monkeypatch):
    engine = _engine(tiny_llama_path, offload=False)
    monkeypatch.setattr(warm_up, "SHORTEST", 32)
    pages = engine.kv.num_total_pages
    monkeypatch.setattr(type(engine.kv), "num_total_pages", property(lambda self: engine.kv.pages_for_tokens(70)))
    assert engine.warm_lengths() == [32, 64]  # 128 and 196 tokens do not fit
    monkeypatch.setattr(type(engine.kv), "num_total_pages", property(lambda self: pages))
    monkeypatch.setattr(warm_up, "LONGEST", 100)
    assert engine.warm_lengths() == [32, 64, 100]  # no longer than LONGEST
    engine.add_request("The capital of France is", PARAMS)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()


def test_warm_batches_decodes_at_every_batch_size_and_leaves_nothing_behind(tiny_llama_path):
    """warm_batches: a batch of made-up prompts drains one request a step, so that a decode
    step runs at every batch size from the largest down to one; no page stays held and the
    engine's tokens for later requests are those of a fresh engine."""
    want = [o.token_ids for o in _engine(tiny_llama_path, True).generate(PROMPTS, PARAMS)]
    engine = _engine(tiny_llama_path, True)
    decoded = []
    execute = engine.runner.execute

    def recording(chunks, *a):
        if chunks and all(c.is_decode for c in chunks):
            decoded.append(len(chunks))
        return execute(chunks, *a)

    engine.runner.execute = recording
    assert warm_up.warm_batches(engine, sizes=3, length=40) == [3, 2, 1]
    assert {3, 2, 1} <= set(decoded) and decoded[-1] == 1  # the last decode step: one row
    assert not engine.has_unfinished() and engine.kv.request_ids() == []
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    engine.check_integrity()
    engine.runner.execute = execute
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want


def test_warm_batches_takes_no_more_prompts_than_the_cache_holds(tiny_llama_path):
    engine = _engine(tiny_llama_path, True)
    need = engine.kv.pages_for_tokens(150 + 8)
    fits = engine.kv.num_total_pages // need
    ran = warm_up.warm_batches(engine, sizes=fits + 5, length=150)
    assert ran and ran[0] <= fits and ran == list(range(ran[0], 0, -1))
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_batch_length_passes_the_floor_and_the_budget(tiny_llama_path, monkeypatch):
    engine = _engine(tiny_llama_path, True)  # a budget of 16 tokens, no floor
    assert warm_up.batch_length(engine) == min(engine.max_model_len - 64, warm_up.SHORTEST)
    monkeypatch.setattr(warm_up, "SHORTEST", 8)
    assert warm_up.batch_length(engine) == 33  # twice the budget, and one more
    for floor, want in ((50, 101), (100, engine.max_model_len - 64)):  # twice the floor and one more, within the model
        sparse = engine.config.sparse.model_copy(update={"budget_floor_tokens": floor})
        monkeypatch.setattr(engine, "config", engine.config.model_copy(update={"sparse": sparse}))
        assert warm_up.batch_length(engine) == want


def test_warm_up_drains_a_batch_where_graphs_are_captured_lazily(tiny_llama_path, monkeypatch):
    """Spin's decode graphs (captured lazily) get the draining batch;
    an engine without them does not."""
    from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs

    calls = []
    monkeypatch.setattr(warm_up, "warm_batches", lambda engine: calls.append(engine) or [])
    engine = _engine(tiny_llama_path, True)
    engine.warm_up([32])
    assert calls == []  # the CPU engine has no decode graphs
    engine.runner.graphs = SpinDecodeGraphs(engine.model, engine.runner.attention, 3, capture=False)
    engine.warm_up([32])
    assert calls == [engine]


def test_warm_batches_capture_no_graph(tiny_llama_path):
    """The draining batch's made-up prompts have a Select width no served request has: no
    graph is captured from them (the graphs' capture flag is off meanwhile, then restored)."""
    from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs

    engine = _engine(tiny_llama_path, True)
    graphs = engine.runner.graphs = SpinDecodeGraphs(engine.model, engine.runner.attention, 3)
    seen = []
    graphs._capture = lambda key: seen.append(key)  # (a CUDA capture; never reached here)
    step = engine.step
    engine.step = lambda: seen.append(graphs.capture) or step()
    assert warm_up.warm_batches(engine, sizes=3, length=40) == [3, 2, 1]
    assert seen[-3:] == [False] * 3  # the draining steps ran with capture off
    assert not [k for k in seen if isinstance(k, tuple)] and graphs.num_graphs == 0
    assert graphs.capture  # restored
