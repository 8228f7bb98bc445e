"""The KV pages' GPU budget: cache.gpu_memory_utilization's arithmetic, and a size the GPU
cannot hold refused with what holds the rest, not left to an out-of-memory error
mid-allocation (CUDA's memory queries stand in for a GPU here)."""

from types import SimpleNamespace

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.kvcache import sizing

GIB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    """A GPU with 40 GiB free and 2 GiB more in torch's cache (reserved, not allocated)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 58 * GIB)
    return torch.device("cuda")


def budget(gib, device, held=0, utilization=0.9, activation=0):
    cfg = SpinConfig.from_dict({"cache": {"kv_cache_gib": gib, "gpu_memory_utilization": utilization}})
    return sizing.gpu_budget_bytes(cfg, device, activation, held)


def test_a_kv_size_that_fits_is_taken_as_given(gpu):
    assert budget(42, gpu) == 42 * GIB  # free plus torch's reusable cache


def test_utilization_gives_the_kv_cache_what_the_model_leaves():
    # An 80 GiB GPU at 0.9: 72 GiB for the engine, 16 of weights and 2 of activations.
    assert sizing.utilization_kv_bytes(80 * GIB, 0.9, 16 * GIB, 2 * GIB) == pytest.approx(54 * GIB)
    assert sizing.utilization_kv_bytes(80 * GIB, 0.2, 16 * GIB, 2 * GIB) < 0  # nothing left


def test_utilization_on_a_gpu_counts_its_total_memory_the_weights_and_the_activations(gpu):
    # 141 GiB in all, 58 allocated (the weights), 42 free with torch's cache; others hold 41.
    assert budget(None, gpu, utilization=0.7) == pytest.approx(0.7 * 141 * GIB - 58 * GIB)
    assert budget(None, gpu, utilization=0.7, activation=GIB) == pytest.approx(0.7 * 141 * GIB - 59 * GIB)
    with pytest.raises(ValueError, match=r"cache.gpu_memory_utilization=0.9 gives the KV cache 68.9 GiB but 42.0 GiB "
                                         r"of the GPU is free beside a step's activations .other processes"):
        budget(None, gpu)
    with pytest.raises(ValueError, match=r"cache.gpu_memory_utilization=0.4 .56.4 GiB of the GPU. leaves the KV cache "
                                         r"nothing: the model holds 58.0 GiB"):
        budget(None, gpu, utilization=0.4)


def test_a_step_s_activations_are_its_widest_tensors_a_context_s_kv_and_the_logits():
    mc = SimpleNamespace(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                         vocab_size=1000)
    cfg = SpinConfig.from_dict({"scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 2}})
    # per token 2 x 64 + (4 + 2 x 2) x 16 + 3 x 128 = 640 values; one layer's K and V of 100
    # tokens 2 x 100 x 2 x 16 = 6400; float32; logits 2 rows x 1000 x 4 bytes
    assert sizing.step_activation_bytes(cfg, mc, torch.float32, 100) == (32 * 640 + 6400) * 4 + 2 * 1000 * 4


def test_a_kv_size_over_the_free_memory_is_refused_with_the_settings_to_change(gpu):
    with pytest.raises(ValueError) as err:
        budget(100, gpu)
    msg = str(err.value)
    assert "cache.kv_cache_gib=100 GiB does not fit: 42.0 GiB of the GPU is free" in msg
    assert "58.0 GiB allocated" in msg and "lower cache.kv_cache_gib" in msg


def test_an_index_already_allocated_counts_inside_the_kv_size(gpu):
    # 10 of the 58 GiB allocated are the algorithm's index: the KV size holds it and the pages.
    assert budget(52, gpu, held=10 * GIB) == 52 * GIB
    assert budget(None, gpu, held=10 * GIB, utilization=0.7) == pytest.approx(0.7 * 141 * GIB - 48 * GIB)
    with pytest.raises(ValueError, match="52.0 GiB of the GPU is free after the model's weights .48.0 GiB"):
        budget(53, gpu, held=10 * GIB)
    with pytest.raises(ValueError, match="cannot hold the sparse algorithm's index .10.0 GiB.*scheduler.max_num_seqs"):
        budget(8, gpu, held=10 * GIB)


def test_the_cpu_budget_is_not_checked_against_a_gpu():
    assert budget(100, torch.device("cpu")) == 100 * GIB


def test_page_slots_leave_room_for_the_index_of_every_page_either_tier_holds():
    # slots of 90 bytes with 10 of index each, and the index of 20 host pages (200 bytes)
    assert sizing.gpu_page_slots(1000, 90, 10.0, 20) == 8
    assert sizing.gpu_page_slots(1000, 100, 0.0, 20) == 10  # an index per request row: no page's
    assert sizing.gpu_page_slots(100, 90, 10.0, 20) == 0


def test_the_buffer_takes_what_max_num_seqs_requests_select_and_home_pages_the_rest():
    cfg = SpinConfig.from_dict({"scheduler": {"max_num_seqs": 2}})
    # 10 slots a request: 1.25 x 2 x 10 = 25 buffer slots; the other 75 are 18 segments of 4
    assert sizing.split_gpu_pages(cfg, 100, 10, 1000, 8, 4) == (25, 18)
    assert sizing.split_gpu_pages(cfg, 40, 10, 1000, 8, 4) == (20, 5)  # the buffer: half at most
    assert sizing.split_gpu_pages(cfg, 100, 10, 8, 1, 4) == (25, 4)  # home pages: 2 requests of 8 pages
    half = cfg.replace(cache={"gpu_home_fraction": 0.5})
    assert sizing.split_gpu_pages(half, 100, 10, 1000, 8, 4) == (50, 12)


def test_full_length_bytes_are_every_page_of_a_full_batch_and_no_more():
    mc = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)
    for host in ("auto", "fp8"):
        cfg = SpinConfig.from_dict({"cache": {"page_size": 16, "host_kv_dtype": host},
                                    "scheduler": {"max_num_seqs": 3}})
        # 3 requests x ceil(100 / 16) = 7 pages x 6 (layer, KV head) columns; in segments of 4 pages, 2 a column
        assert (sizing.full_length_segments(cfg, mc, 100), sizing.full_length_segments(cfg, mc, 100, 4)) == (126, 36)
        gpu_bytes, host_bytes = sizing.full_length_bytes(cfg, mc, torch.bfloat16, 100, 4)
        assert gpu_bytes == 126 * 2 * 16 * 16 * 2  # K and V of 16 tokens x 16 dims in bfloat16 a page
        for spare, segments in ((0, 36), (-1, 35)):
            sized = cfg.replace(cache={"host_kv_gib": (host_bytes + spare) / GIB})
            assert sizing.host_tier_segments(sized, mc, torch.bfloat16, 100, 4) == segments
