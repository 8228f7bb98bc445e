"""The hybrid cache: window layers paged, global layers offloaded, one request-level API."""

import pytest
import torch

from spin_cluster.kvcache.hybrid import HybridKVCache, LayerSplit
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.offloaded import OffloadedKVManager

S, D, MAX_LEN = 4, 8, 32
WINDOWS = (8, None, 8, 8)  # layer 1 is the global one


def _cache(num_paged_pages: int = 64) -> HybridKVCache:
    split = LayerSplit.of(WINDOWS)
    paged = KVCacheManager(num_layers=3, num_kv_heads=1, head_dim=D, page_size=S, num_pages=num_paged_pages,
                           max_seqs=3, max_model_len=MAX_LEN, dtype=torch.float32, layer_windows=(8, 8, 8))
    spin = OffloadedKVManager(
        num_layers=1, num_kv_heads=1, head_dim=D, page_size=S, segment_pages=1, num_host_segments=16,
        num_buffer_slots=12, buffer_pages_per_head=4, mandatory_pages_per_head=2, max_seqs=3,
        max_model_len=MAX_LEN, dtype=torch.float32, device="cpu", num_buckets=4,
    )
    return HybridKVCache(split, paged, spin)


def test_layers_are_numbered_in_their_part():
    split = LayerSplit.of(WINDOWS)
    assert (split.window_layers, split.global_layers) == ((0, 2, 3), (1,))
    assert split.part_of() == [(True, 0), (False, 0), (True, 1), (True, 2)]


def test_rows_of_the_parts_are_mapped_where_they_differ():
    kv = _cache()
    kv.allocate("a", 5)
    kv.paged.allocate("ghost", 1)  # takes the paged part's next row: the parts' rows now differ
    kv.allocate("b", 5)
    rows = torch.tensor([kv.row("b"), kv.row("a")])
    assert kv.paged_rows(rows).tolist() == [kv.paged.table.row("b"), kv.paged.table.row("a")]
    assert kv.row("b") != kv.paged.table.row("b")
    kv.paged.free("ghost")
    kv.check_integrity()


def test_admission_needs_both_parts_and_free_gives_both_back():
    kv = _cache(num_paged_pages=5)  # one request of 4 tokens takes a page in each of three layers
    start = (kv.paged.num_free_pages, kv.spin.num_free_pages)
    assert kv.can_allocate("a", 4)
    kv.allocate("a", 4)
    assert kv.spin.can_allocate("b", 4) and not kv.paged.can_allocate("b", 4)
    assert not kv.can_allocate("b", 4)
    kv.free("a")
    kv.check_integrity()
    assert (kv.paged.num_free_pages, kv.spin.num_free_pages) == start


def test_window_pages_are_freed_behind_the_window_on_commit():
    kv = _cache()
    kv.allocate("a", 8)
    kv.allocate("a", 24)  # a chunk of 16: its last query's window starts on page 4
    assert kv.paged.num_layer_pages("a") == [4, 4, 4]  # pages 0, 1, 4, 5
    kv.commit("a", 24, lambda a, b: [0] * (b - a))
    assert kv.paged.num_layer_pages("a") == [2, 2, 2]  # keys 17 .. 23: pages 4 and 5
    assert kv.spin.num_free_pages == kv.spin.num_total_pages - kv.spin.pages_for_tokens(24)
    kv.check_integrity()


def test_a_model_without_global_layers_is_refused():
    with pytest.raises(ValueError, match="kind=paged"):
        split = LayerSplit.of((8, 8))
        paged = _cache().paged
        HybridKVCache(split, paged, _cache().spin)
