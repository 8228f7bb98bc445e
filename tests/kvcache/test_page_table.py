import pytest
import torch

from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.page_pool import PagePool


def _kv(num_pages=24, page_size=4, layers=2, heads=2, max_seqs=3, max_len=32):
    return KVCacheManager(
        num_layers=layers, num_kv_heads=heads, head_dim=8, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_model_len=max_len, dtype=torch.float32,
    )


def test_pool_hands_out_lowest_ids_first_and_takes_them_back():
    pool = PagePool(6, 4, 8, torch.float32)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([0, 1])
    assert pool.num_free == 3
    assert pool.allocate(3) == [0, 1, 5]
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(1)


def test_allocate_grows_by_whole_pages_per_layer_and_head():
    kv = _kv()
    kv.allocate("a", 5)  # 2 logical pages x (2 layers x 2 heads) = 8 physical pages
    assert kv.num_free_pages == 24 - 8
    kv.allocate("a", 8)  # still 2 logical pages
    assert kv.num_free_pages == 16
    kv.allocate("a", 9)
    assert kv.num_free_pages == 12
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_pages == 24
    kv.check_integrity()


def test_table_layout_and_slot_mapping_name_exact_slots():
    kv = _kv()
    kv.allocate("a", 4)  # page ids 0..3 ordered [L, Hkv]: (l0,h0)=0 (l0,h1)=1 (l1,h0)=2 (l1,h1)=3
    kv.allocate("b", 6)  # pages 4..7 then 8..11
    row_b = kv.table.row("b")
    assert kv.table.table[row_b, :, :, :2].tolist() == [[[4, 8], [5, 9]], [[6, 10], [7, 11]]]
    rows = torch.tensor([row_b, row_b])
    pos = torch.tensor([1, 5])
    slots = kv.slot_mapping(rows, pos)  # [L, T, Hkv]
    S = 4
    assert slots.tolist() == [
        [[4 * S + 1, 5 * S + 1], [8 * S + 1, 9 * S + 1]],
        [[6 * S + 1, 7 * S + 1], [10 * S + 1, 11 * S + 1]],
    ]


def test_can_allocate_refuses_past_the_pool_and_past_the_request_rows():
    kv = _kv(num_pages=8, max_seqs=2)
    assert kv.can_allocate("a", 8)
    assert not kv.can_allocate("a", 9)
    kv.allocate("a", 1)
    kv.allocate("b", 1)
    assert not kv.can_allocate("c", 1)  # no free row
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate("a", 33)


def test_integrity_check_catches_a_page_owned_twice():
    kv = _kv()
    kv.allocate("a", 4)
    kv.pool.free([0])  # a bug: page 0 is still in a's table
    with pytest.raises(AssertionError, match="twice"):
        kv.check_integrity()


def test_integrity_check_catches_a_lost_page():
    kv = _kv()
    kv.allocate("a", 4)
    kv.table._request_to_pages["a"][0].pop()
    with pytest.raises(AssertionError, match="lost"):
        kv.check_integrity()
