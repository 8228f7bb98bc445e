"""Quest's index on the offloaded cache is kept per logical page that the cache hands out, so
it is sized by what the GPU and host tiers hold, not by max_num_seqs x max_model_len, and it
lives inside cache.kv_cache_gib with the pages."""

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kvcache.buffer_policy import BufferPolicy

S, E = 4, 2  # tokens per page, pages per segment
L, HKV, D = 2, 2, 16  # the tiny Llama: 2 layers, 2 KV heads, head dim 64 / 4


def _engine(path, kv_cache_gib, host_kv_gib, max_num_seqs=16, max_model_len=512):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": max_model_len},
        "cache": {"page_size": S, "kind": "offloaded", "kv_cache_gib": kv_cache_gib,
                  "host_kv_gib": host_kv_gib},
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 64},
        "sparse": {"algorithm": "quest", "budget": 16, "sink_tokens": 4, "local_tokens": 8},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=BufferPolicy(segment_pages=E))


def test_the_index_holds_the_pages_the_tiers_hold_and_fits_the_kv_size(tiny_llama_path):
    slot = 2 * S * D * 4  # float32 K and V of one page of one (layer, head)
    index_page = 2 * L * HKV * D * 4  # float32 bounds of one logical page, every layer and head
    gib = 3000 * slot / 2**30
    eng = _engine(tiny_llama_path, kv_cache_gib=gib, host_kv_gib=2000 * slot / 2**30)
    kv, quest = eng.kv, eng.runner.attention.algorithm
    per = L * HKV
    tier_pages = kv.homes.num_segments * E
    assert kv.directory.num_logical_segments == kv.homes.num_segments // per
    assert quest.kmin.shape[1] == kv.directory.num_logical_segments * E + 1  # + the dump row
    assert quest.kmin.shape[1] < 16 * (512 // S)  # far less than every row at full length
    # Pages (buffer and GPU homes) and the index of every page of both tiers, within the KV size.
    gpu_slots = kv.buffer.k_slots.shape[0]
    assert gpu_slots * slot + index_page * tier_pages // per <= gib * 2**30
    assert gpu_slots * slot > 0.8 * gib * 2**30 - index_page * tier_pages // per  # and most of it used


def test_index_pages_pass_from_request_to_request_without_changing_tokens(tiny_llama_path):
    """Eight requests through two rows: each takes index pages that earlier ones left, and
    greedy tokens are those of each request alone on a fresh engine."""
    prompts = [[100 + 7 * i + j for j in range(40 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [_engine(tiny_llama_path, 0.002, 0.002, max_num_seqs=2, max_model_len=256).generate([p], params)[0].token_ids
             for p in prompts[:3]]
    eng = _engine(tiny_llama_path, 0.002, 0.002, max_num_seqs=2, max_model_len=256)
    outs = eng.generate(prompts, params)
    eng.check_integrity()
    assert eng.kv.num_free_pages == eng.kv.num_total_pages
    assert (eng.kv.directory.logical_ids == -1).all()  # every request's index pages returned
    assert [o.token_ids for o in outs[:3]] == alone
    taken = torch.tensor(eng.kv.directory._free_logical.ids())
    assert taken.unique().numel() == eng.kv.directory.num_logical_segments
