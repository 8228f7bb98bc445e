"""Prefix caching in the engine (tiny random Llama on the CPU): greedy tokens are those of an
engine without it, whether prompts sharing a prefix run together or one after another,
pipelined or not, under preemption and eviction; and the hits are the pages expected."""

import random

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

PAGE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(path, prefix_caching, *, async_decode=False, kv_cache_gib=None, max_num_seqs=4):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"page_size": PAGE, "enable_prefix_caching": prefix_caching, "kv_cache_gib": kv_cache_gib},
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 64, "async_decode": async_decode},
    }
    # Room kept for prompts only: preemptions happen.
    return Engine(SpinConfig.from_dict(cfg), progress=False, admission_output_tokens=0)


def _prompts():
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    base = ids(6 * PAGE)
    return [
        base + ids(3),  # 27 tokens
        base + ids(2),  # 26: shares base's 6 pages
        base,  # 24, a multiple of the page size: cached whole, its last page is recomputed
        base,  # the same prompt again
        base[:10] + ids(6),  # 16: shares 2 full pages, then differs inside the third
        base[PAGE : 3 * PAGE] + ids(3),  # 11: base's pages 1 and 2 at other positions: no hit
        ids(13),  # nothing in common
    ]


@pytest.fixture(scope="module")
def without(tiny_llama_path):
    """Tokens of an engine without prefix caching: all prompts together, and one at a time."""
    engine = _engine(tiny_llama_path, False)
    together = [o.token_ids for o in engine.generate(_prompts(), PARAMS)]
    alone = [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()]
    assert engine.scheduler.num_prefix_query_tokens == 0 and engine.kv.prefixes.num_published == 0
    return together, alone


def _check_all_freed(engine):
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages and not engine.has_unfinished()


@pytest.mark.parametrize("async_decode", [False, True])
def test_one_after_another_the_tokens_are_the_same_and_the_hits_are_the_shared_pages(
        tiny_llama_path, without, async_decode):
    engine = _engine(tiny_llama_path, True, async_decode=async_decode)
    alone = [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()]
    assert alone == without[1]
    # base+2 hits base's 6 pages; base twice 5 (its last token is computed); the fourth 2 pages
    assert engine.scheduler.num_prefix_hit_tokens == 6 * PAGE + 5 * PAGE + 5 * PAGE + 2 * PAGE
    assert engine.scheduler.num_prefix_query_tokens == sum(map(len, _prompts()))
    stats = engine.last_stats
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (141, 72)
    _check_all_freed(engine)
    if async_decode:
        assert engine.num_pipelined_steps > 0


@pytest.mark.parametrize("async_decode", [False, True])
def test_together_the_tokens_are_the_same(tiny_llama_path, without, async_decode):
    engine = _engine(tiny_llama_path, True, async_decode=async_decode)
    # 141 prompt tokens over steps of 64: later prompts are admitted after earlier ones' pages
    # are written, and a second round finds every prompt's pages cached
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(_prompts(), PARAMS)] == without[0]
        _check_all_freed(engine)
    assert engine.scheduler.num_prefix_hit_tokens > 141 - 7 * PAGE


def test_under_preemption_and_eviction_the_tokens_are_the_same(tiny_llama_path, without):
    # 16 logical pages (4 tokens x 2 layers x 2 KV heads x 16 dims x fp32 K and V = 2 KiB
    # each): four requests of ~35 tokens need 36
    engine = _engine(tiny_llama_path, True, kv_cache_gib=16 * 2048 / 2**30)
    assert engine.kv.num_total_pages == 16 * 4
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(_prompts(), PARAMS)] == without[0]
        _check_all_freed(engine)
    assert engine.num_preemptions_total > 0 and engine.scheduler.num_prefix_hit_tokens > 0


def test_the_setting_must_be_a_bool_and_the_offloaded_cache_ignores_it(tiny_llama_path):
    with pytest.raises(ValueError, match="cache.enable_prefix_caching='yes': use true or false"):
        SpinConfig.from_dict({"cache": {"enable_prefix_caching": "yes"}})
    assert SpinConfig().cache.enable_prefix_caching
    cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
           "cache": {"page_size": PAGE, "kind": "offloaded", "enable_prefix_caching": True}}
    engine = Engine(SpinConfig.from_dict(cfg), progress=False)
    prompt = _prompts()[0]
    first, second = (engine.generate([prompt], PARAMS)[0].token_ids for _ in range(2))
    assert first == second and not engine.kv.prefix_caching
    assert (engine.last_stats.prefix_cache_queries_total, engine.last_stats.prefix_cache_hits_total) == (0, 0)


@pytest.mark.parametrize("shared", [True, False])
def test_choices_of_one_prompt_prefill_it_once(tiny_llama_path, shared):
    """n choices: the later ones wait for the first's prompt (prefill_after) and take its pages;
    added together without it, each computes the prompt itself."""
    engine = _engine(tiny_llama_path, True)
    prompt = _prompts()[0]  # 27 tokens: 6 full pages before the last token
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    first = engine.add_request(prompt, params)
    for i in range(3):
        engine.add_request(prompt, SamplingParams(temperature=0.8, seed=4 + i, max_tokens=8, ignore_eos=True),
                           prefill_after=first if shared else None)
    computed = 0
    while engine.has_unfinished():
        engine.step()
        computed += engine.last_stats.num_batched_tokens
    hits = engine.scheduler.num_prefix_hit_tokens
    # unshared: three prompts start in the first step's 64 tokens (the third's first 10), and
    # only the fourth, admitted a step later, finds the first's pages
    assert hits == (3 * 6 * PAGE if shared else 6 * PAGE)
    assert computed == 4 * (27 + 7) - hits
    engine.check_integrity()
