"""The cache builder: ``cache.kind`` names the KV cache it makes (a model with sliding-window
layers takes the hybrid cache where the config asks for the offloaded one), and the offloaded
cache's buffer follows the ``BufferPolicy`` the engine is given."""

from types import SimpleNamespace

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine
from spin_cluster.engine.cache_builder import CACHE_KINDS, cache_kind
from spin_cluster.kvcache.buffer_policy import BufferPolicy
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.offloaded import OffloadedKVManager

WINDOWED = SimpleNamespace(layer_windows=(512, None))  # a Gemma-3-like model: a window layer, a global one
FULL = SimpleNamespace(layer_windows=())


@pytest.mark.parametrize("kind, mc, built", [
    ("paged", FULL, "paged"),
    ("paged", WINDOWED, "paged"),
    ("offloaded", FULL, "offloaded"),
    ("offloaded", WINDOWED, "hybrid"),
    ("offloaded", None, "offloaded"),
])
def test_the_kind_and_the_models_windows_name_the_cache(kind, mc, built):
    assert cache_kind(SpinConfig.from_dict({"cache": {"kind": kind}}), mc) == built
    assert built in CACHE_KINDS


def test_the_default_is_the_paged_cache():
    assert SpinConfig().cache.kind == "paged" and cache_kind(SpinConfig(), FULL) == "paged"


@pytest.mark.parametrize("kind, manager", [("paged", KVCacheManager), ("offloaded", OffloadedKVManager)])
def test_the_engine_builds_the_cache_the_kind_names(tiny_llama_path, kind, manager):
    cfg = SpinConfig.from_dict({
        "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 128},
        "cache": {"kind": kind, "page_size": 4, "kv_cache_gib": 0.01, "host_kv_gib": 0.01},
        "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64},
    })
    assert type(Engine(cfg, progress=False).kv) is manager


def _offloaded(path, **policy):
    cfg = SpinConfig.from_dict({
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"kind": "offloaded", "page_size": 4, "kv_cache_gib": 0.01, "host_kv_gib": 0.01},
        "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64},
        "sparse": {"algorithm": "quest", "budget": 16, "budget_floor_tokens": 0, "sink_tokens": 4, "local_tokens": 8},
    })
    return Engine(cfg, progress=False, **({"buffer_policy": BufferPolicy(**policy)} if policy else {})).kv


def test_the_cache_builder_applies_the_policy(tiny_llama_path):
    kv = _offloaded(tiny_llama_path)  # no policy given: the default, and the LRU's 64 recency buckets
    assert (kv.host.segment_pages, kv.buffer.num_buckets, kv.buffer.reuse, kv.elastic_shares) == (64, 64, True, True)
    assert kv.buffer.max_share == 256 // 4  # buffer_share 0: a share may grow to the request's every page
    kv = _offloaded(tiny_llama_path, segment_pages=4, reuse=False, elastic_shares=False, pages_per_head=12)
    assert (kv.host.segment_pages, kv.buffer.reuse, kv.elastic_shares) == (4, False, False)
    assert kv.buffer.max_share == 12
