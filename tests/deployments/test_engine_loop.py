"""The engine loop (one thread owns the Engine) on a toy model, without Ray."""

import queue

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.deployments.engine_loop import EngineLoop
from spin_cluster.deployments.engine_stats import engine_report, free_kv_tokens
from spin_cluster.deployments.messages import Admitted, Delta, Failed
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kvcache.buffer_policy import BufferPolicy

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
           "cache": {"kv_cache_gib": 0.01}, "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 256}}
    return Engine(SpinConfig.from_dict(cfg), progress=False)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def expected(engine):
    """The engine's own outputs, before any loop thread owns it."""
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture
def loop(engine, expected):
    lp = EngineLoop(engine, idle_wait_s=0.05)
    lp.start()
    yield lp
    lp.stop()
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _items(q: "queue.Queue", timeout_s: float = 60.0):
    while True:
        item = q.get(timeout=timeout_s)
        yield item
        if isinstance(item, Failed) or (isinstance(item, Delta) and item.finished):
            return


def test_outputs_equal_the_engines_own(loop, expected):
    sinks = [queue.Queue() for _ in PROMPTS]
    for i, (ids, q) in enumerate(zip(PROMPTS, sinks)):
        loop.submit(f"r{i}", ids, PARAMS, q.put)
    for ids, q, want in zip(PROMPTS, sinks, expected):
        items = list(_items(q))
        assert items[0] == Admitted(len(ids))
        assert [t for d in items[1:] for t in d.token_ids] == want
        assert items[-1].finish_reason == "length"


def test_a_bad_prompt_fails_alone(loop):
    q = queue.Queue()
    loop.submit("bad", [1] * 300, PARAMS, q.put)  # past max_model_len
    item = q.get(timeout=30)
    assert isinstance(item, Failed) and item.status == 400 and "context" in item.message


def test_abort_stops_the_request_and_frees_its_pages(loop):
    q = queue.Queue()
    loop.submit("long", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), q.put)
    assert isinstance(q.get(timeout=30), Admitted)
    assert isinstance(q.get(timeout=30), Delta)
    loop.abort("long")
    info = loop.call(lambda e: (e.check_integrity(), e.has_unfinished(), e.kv.num_free_pages == e.kv.num_total_pages))
    assert info.result(timeout=30) == (None, False, True)


def test_queue_counts_follow_aborts_at_once(engine, expected):
    """Admission control reads num_queued(): it must not wait for the loop's idle wake-up."""
    lp = EngineLoop(engine, idle_wait_s=5.0)
    lp.start()
    try:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        for i in range(6):  # max_num_seqs is 4: at least two wait
            lp.submit(f"q{i}", [5, 6, 7], long, lambda item: None)
        lp.call(lambda e: None).result(timeout=30)  # a barrier: the commands before it have run
        assert lp.num_queued() >= 2
        for i in range(6):
            lp.abort(f"q{i}")
        lp.call(lambda e: None).result(timeout=30)
        assert lp.num_queued() == 0
    finally:
        lp.stop()
    engine.check_integrity()


def test_a_sink_that_fails_aborts_its_request(loop):
    calls = []

    def broken(item):
        calls.append(item)
        raise RuntimeError("reader gone")

    loop.submit("orphan", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True), broken)
    # Commands run in order: by the time this one runs, the add and its abort have.
    assert loop.call(lambda e: e.has_unfinished()).result(timeout=30) is False
    assert len(calls) == 1 and isinstance(calls[0], Admitted)


def test_report_counts_free_capacity(engine, expected):
    rep = engine_report(engine, "r")
    assert rep.kv_pages[("gpu", "free")] == engine.kv.num_total_pages
    assert rep.free_kv_tokens == free_kv_tokens(engine.kv, engine.kv.num_total_pages) > 0
    assert rep.free_kv_tokens == engine.kv.free_token_capacity()
    assert rep.attention_rank_s == {"0": 0.0}
    # prefix caching is on by default: the prompts' tokens were looked up (too short to hit)
    assert rep.counters["prefix_cache_queries"] == engine.scheduler.num_prefix_query_tokens > 0
    assert rep.counters["prefix_cache_hits"] == 0


def test_queued_deltas_go_to_the_ingress_as_one():
    """A slow consumer gets every token already queued in one hop; a finished Delta ends the
    merge, and an item that is not a Delta is handed back, not lost."""
    import asyncio

    from spin_cluster.deployments.engine_server import _coalesce

    def d(text, ids, finished=False):
        return Delta(text=text, token_ids=ids, finished=finished, finish_reason="length" if finished else None)

    q: asyncio.Queue = asyncio.Queue()
    for item in (d("b", (2,)), d("c", (3, 4)), d("e", (5,), True), d("x", (9,))):
        q.put_nowait(item)
    merged, held = _coalesce(d("a", (1,)), q)
    assert merged == d("abce", (1, 2, 3, 4, 5), True) and held is None and q.qsize() == 1
    assert _coalesce(d("a", (1,)), asyncio.Queue()) == (d("a", (1,)), None)  # nothing queued: as is
    q = asyncio.Queue()
    failed = Failed(500, "boom")
    for item in (d("b", (2,)), failed, d("c", (3,))):
        q.put_nowait(item)
    merged, held = _coalesce(d("a", (1,)), q)
    assert merged == d("ab", (1, 2)) and held is failed and q.qsize() == 1
    admitted = Admitted(num_prompt_tokens=3)
    assert _coalesce(admitted, q) == (admitted, None) and q.qsize() == 1  # only Deltas merge


def test_deltas_of_different_choices_stay_apart_and_logprobs_merge():
    import asyncio

    from spin_cluster.deployments.engine_server import _coalesce
    from spin_cluster.deployments.messages import TokenLogprob

    lp = [TokenLogprob(t, -1.0) for t in "abc"]
    q: asyncio.Queue = asyncio.Queue()
    other = Delta("x", (9,), False, None, index=1)
    for item in (Delta("b", (2,), False, None, logprobs=(lp[1],)), other, Delta("c", (3,), False, None)):
        q.put_nowait(item)
    first = Delta("a", (1,), False, None, logprobs=(lp[0],), prompt_logprobs=(lp[2],))
    merged, held = _coalesce(first, q)
    assert merged == Delta("ab", (1, 2), False, None, logprobs=tuple(lp[:2]), prompt_logprobs=(lp[2],))
    assert held is other and q.qsize() == 1


def test_report_of_the_offloaded_cache_gives_both_home_tiers_and_the_buffer(tiny_llama_path):
    """Pages at home on the GPU and on the host, and the buffer's slots, each with their bytes;
    a GPU home of a few segments makes the long prompt spill."""
    cfg = SpinConfig.from_dict({
        "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 512},
        "cache": {"kind": "offloaded", "page_size": 16, "host_kv_gib": 0.01, "kv_cache_gib": 0.002,
                  "gpu_home_fraction": 0.05},
        "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 512},
    })
    eng = Engine(cfg, progress=False, buffer_policy=BufferPolicy(segment_pages=1))
    eng.add_request(list(range(5, 400)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    kv, rep = eng.kv, engine_report(eng, "r")
    tiers = kv.tier_pages()
    assert rep.kv_pages[("gpu", "used")] == tiers["gpu"][0] == tiers["gpu"][1] > 0  # the GPU filled
    assert rep.kv_pages[("host", "used")] == tiers["host"][0] > 0  # and the rest went to the host
    assert rep.kv_pages[("gpu_buffer", "free")] + rep.kv_pages[("gpu_buffer", "used")] == kv.buffer.num_slots
    assert rep.kv_bytes[("host", "used")] == rep.kv_pages[("host", "used")] * kv.buffer.page_bytes
    assert rep.counters["spilled_pages"] == 0 and rep.counters["preemptions"] == 0  # born where they fit
    eng.add_request(list(range(7, 200)), SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
    rep = engine_report(eng, "r")
    assert rep.counters["spilled_pages"] == kv.num_spilled_segments > 0  # the newcomer's pages took the GPU


@pytest.mark.parametrize("warmup, runs", [(True, True), (None, False), (False, False)])
def test_a_plain_replica_warms_its_engine_when_asked_and_on_cuda_by_default(tiny_llama_path, monkeypatch,
                                                                           warmup, runs):
    from spin_cluster.config import SpinConfig
    from spin_cluster.deployments.engine_server import _build_engine
    from spin_cluster.deployments.messages import EnginePlan
    from spin_cluster.engine import Engine

    called = []
    monkeypatch.setattr(Engine, "warm_up", lambda self, lengths=None: called.append(self) or [])
    spin = SpinConfig.from_dict({"model": {"path": tiny_llama_path, "device": "cpu", "max_model_len": 64}})
    engine = _build_engine(spin, EnginePlan(sparse={}), 5.0, warmup=warmup)
    assert called == ([engine] if runs else [])  # the CPU: off unless asked
