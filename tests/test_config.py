"""The engine config's sections: each failure is one line naming the field and what to change."""

import pytest

from spin_cluster.config import CacheConfig, SpinConfig


@pytest.mark.parametrize("data, message", [
    ({"cache": {"page_size": 3}}, "cache.page_size=3: use a power of two in 1..256"),
    ({"cache": {"gpu_memory_utilization": 0}}, "cache.gpu_memory_utilization=0: must be > 0"),
    ({"cache": {"gpu_memory_utilization": 1.5}}, "cache.gpu_memory_utilization=1.5: must be <= 1"),
    ({"cache": {"host_kv_gib": -1}}, "cache.host_kv_gib=-1: must be >= 0"),
    ({"cache": {"gpu_home_fraction": 1}}, "cache.gpu_home_fraction=1: must be < 1"),
    ({"cache": {"host_kv_dtype": "int4"}}, "cache.host_kv_dtype='int4': choose one of 'auto' or 'fp8'"),
    ({"cache": {"kind": "host"}}, "cache.kind='host': choose one of 'paged' or 'offloaded'"),
    ({"cache": {"offload": True}}, "cache.offload is now cache.kind: offloaded (offload true) or paged (offload false)"),
    ({"cache": {"offload": False, "page_size": 8}},
     "cache.offload is now cache.kind: offloaded (offload true) or paged (offload false)"),
    ({"cache": {"segment_pages": 16}}, "cache.segment_pages is no longer a setting: the GPU buffer's mechanisms keep "
     "their defaults (studies move them through spin_cluster.kvcache.buffer_policy.BufferPolicy); remove it"),
    ({"cache": {"lru_buckets": 8}}, "cache.lru_buckets is no longer a setting (the GPU buffer's LRU keeps 64 recency "
     "buckets); remove it"),
    ({"cache": {"buffer_reuse": False}}, "cache.buffer_reuse is no longer a setting: the GPU buffer's mechanisms keep "
     "their defaults (studies move them through spin_cluster.kvcache.buffer_policy.BufferPolicy); remove it"),
    ({"cache": {"kv_cache_dtype": "int8"}}, "cache.kv_cache_dtype='int8': choose one of 'auto', 'float16' or 'float32'"),
    ({"cache": {"kind": "offloaded", "kv_cache_dtype": "float16"}}, "cache.kv_cache_dtype='float16' applies to the paged "
     "cache; the offloaded cache's host pages take cache.host_kv_dtype"),
    ({"cache": ["page_size"]}, "cache=['page_size']: must be a mapping, got list"),
    ({"model": {"cpu_packed_gemms": False}}, "model.cpu_packed_gemms is no longer a setting: float32 GEMMs on the "
     "CPU are always prepacked for oneDNN (faster at every batch measured: SmolLM2's decode step 1.1x at batch 1, "
     "2x at batch 4, 1.4x at batch 16); remove it"),
    ({"model": {"dtype": "int8"}}, "model.dtype='int8': choose one of 'auto', 'float32', 'bfloat16' or 'float16'"),
    ({"model": {"max_model_len": 1.5}}, "model.max_model_len=1.5: use an integer"),
    ({"scheduler": {"max_prefill_tokens": 512}}, "scheduler.max_prefill_tokens is no longer a setting: prompt chunks "
     "take what scheduler.max_num_batched_tokens leaves after the decode tokens (every measured run did); remove it"),
    ({"scheduler": {"admission_output_tokens": 0}}, "scheduler.admission_output_tokens is no longer a setting: "
     "admission keeps room for 2048 output tokens of each running request beside the prompts (a test or benchmark "
     "that must force preemptions passes Engine(admission_output_tokens=0)); remove it"),
    ({"scheduler": {"max_num_seqs": 5000}}, "scheduler.max_num_seqs=5000: must be <= 4096"),
    ({"sparse": {"budget": -1}}, "sparse.budget=-1: must be > 0"),
    ({"sparse": {"algorithm": "quest", "options": {"top_p": "x"}}}, "sparse.options.top_p='x': use a number"),
    ({"sparse": {"algorithm": "streaming", "options": {"top_p": 0.9}}},
     "sparse.options: 'streaming' takes no option 'top_p'; its options: index_dtype"),
    ({"sparse": {"top_p": 0.9}}, "sparse.top_p moved to sparse.options.top_p"),
    ({"sparse": {"resident_margin": 0.5}}, "sparse.resident_margin moved to sparse.options.resident_margin"),
    ({"sparse": {"algorithm": "streaming", "options": {"resident_margin": 0.5}}},
     "sparse.options: 'streaming' takes no option 'resident_margin'; its options: index_dtype"),
    ({"sparse": {"budget_floor_tokens": -1}}, "sparse.budget_floor_tokens=-1: must be >= 0"),
    ({"sparse": {"budget_floor_tokens": 1.5}}, "sparse.budget_floor_tokens=1.5: use an integer"),
    ({"sparse": {"per_head_budgets": [[64, 32]]}}, "sparse.per_head_budgets moved to sparse.options.per_head_budgets"),
    ({"sparse": {"algorithm": "quest", "options": {"per_head_budgets": 5}}},
     "sparse.options.per_head_budgets=5: must be a list, got int"),
    ({"sparse": {"algorithm": "quest", "options": {"per_head_budgets": [[1, "a"]]}}},
     "sparse.options.per_head_budgets[0][1]='a': use an integer"),
    ({"sparse": {"algorithm": "labels", "options": {"per_head_budgets": [[64, -16]]}}},
     "sparse.options.per_head_budgets must be >= 0"),
    ({"sparse": {"algorithm": "streaming", "options": {"per_head_budgets": [[64, 32]]}}},
     "sparse.options: 'streaming' takes no option 'per_head_budgets'; its options: index_dtype"),
    ({"sparse": {"options": {"per_head_budgets": [[64, 32]]}}},
     "sparse.options: 'dense' takes no option 'per_head_budgets'; its options: index_dtype"),
    ({"sparse": {"prefill": {"algorithm": "block", "options": {"coverage": 0}}}},
     "sparse.prefill.options.coverage=0: must be > 0"),
    ({"sparse": {"prefill": {"algorithm": "block", "options": {"profile": "p.json", "budget": 2}}}},
     "sparse.prefill.options.budget=2.0: with a profile give the mean as a fraction in (0, 1)"),
    ({"sparse": {"prefill": {"algorithm": "block", "options": {"block_sizes": 32}}}},
     "sparse.prefill.options: 'block' takes no option 'block_sizes'; its options: block_size, budget, budgets, "
     "coverage, estimator, local_blocks, per_head_budgets, profile, sink_blocks, stride, threshold"),
    ({"sparse": {"prefill": {"options": {"budget": 0.5}}}},
     "sparse.prefill.options: 'dense' takes no option 'budget'; its options: none"),
    ({"sparse": {"prefill": {"algorithm": "block", "block_size": 32}}},
     "sparse.prefill.block_size moved to sparse.prefill.options.block_size"),
    ({"cache": {"segment": 4}}, "cache.segment: unknown key; known: buffer_share, enable_prefix_caching, "
     "gpu_home_fraction, gpu_memory_utilization, host_kv_dtype, host_kv_gib, kind, kv_cache_dtype, kv_cache_gib, "
     "page_size"),
    ({"caches": {}}, "caches: unknown config section; known: cache, model, scheduler, sparse"),
])
def test_a_bad_value_is_one_line_naming_the_field(data, message):
    with pytest.raises(ValueError) as e:
        SpinConfig.from_dict(data)
    assert str(e.value) == message


def test_sections_are_frozen_and_round_trip():
    cfg = SpinConfig.from_dict({"cache": None, "sparse": {"algorithm": "quest", "prefill": None,
                                                          "options": {"per_head_budgets": [[64, 32.0]]}}})
    assert cfg.cache == CacheConfig() and cfg.sparse.per_head_budgets == ((64, 32),)  # whole tokens
    assert SpinConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="frozen"):
        cfg.cache.page_size = 32
    assert cfg.replace(cache={"page_size": 32}).cache.page_size == 32
    with pytest.raises(ValueError, match="^cache.page_size=33: use a power of two"):
        cfg.replace(cache={"page_size": 33})


def test_every_field_says_what_it_is():
    from spin_cluster.config import (BlockPrefillOptions, ModelOptions, SchedulerConfig, SparseConfig,
                                     SparsePrefillConfig)

    for section in (SpinConfig, ModelOptions, CacheConfig, SchedulerConfig, SparseConfig, SparsePrefillConfig,
                    BlockPrefillOptions):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"
