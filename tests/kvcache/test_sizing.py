"""The KV pages' GPU budget: a cache.kv_cache_gib the GPU cannot hold is refused with what
holds the rest, not left to an out-of-memory error mid-allocation (CUDA's memory queries
stand in for a GPU here)."""

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


def budget(gib, device, held=0):
    cfg = SpinConfig.from_dict({"cache": {"kv_cache_gib": gib}} if gib is not None else {})
    return sizing.gpu_budget_bytes(cfg, device, held)


def test_a_kv_size_that_fits_is_taken_as_given(gpu):
    assert budget(42, gpu) == 42 * GIB  # free plus torch's reusable cache
    assert budget(None, gpu) == pytest.approx(42 * GIB * sizing._GPU_KV_FRACTION)


def test_a_kv_size_over_the_free_memory_is_refused_with_the_settings_to_change(gpu):
    with pytest.raises(ValueError) as err:
        budget(100, gpu)
    msg = str(err.value)
    assert "cache.kv_cache_gib=100 GiB does not fit: 42.0 GiB of the GPU is free" in msg
    assert "58.0 GiB allocated" in msg and "lower cache.kv_cache_gib" in msg


def test_an_index_already_allocated_counts_inside_the_kv_size(gpu):
    # 10 of the 58 GiB allocated are the algorithm's index: the KV size holds it and the pages.
    assert budget(52, gpu, held=10 * GIB) == 52 * GIB
    assert budget(None, gpu, held=10 * GIB) == pytest.approx(42 * GIB * sizing._GPU_KV_FRACTION + 10 * GIB)
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
    cfg = SpinConfig.from_dict({"cache": {"segment_pages": 4}, "scheduler": {"max_num_seqs": 2}})
    # 10 slots a request: 1.25 x 2 x 10 = 25 buffer slots; the other 75 are 18 segments of 4
    assert sizing.split_gpu_pages(cfg, 100, 10, 1000, 8) == (25, 18)
    assert sizing.split_gpu_pages(cfg, 40, 10, 1000, 8) == (20, 5)  # the buffer: half at most
    assert sizing.split_gpu_pages(cfg, 100, 10, 8, 1) == (25, 4)  # home pages: 2 requests of 8 pages
    half = cfg.replace(cache={"gpu_home_fraction": 0.5})
    assert sizing.split_gpu_pages(half, 100, 10, 1000, 8) == (50, 12)
