"""Sliding-window layers in the GPU-only cache: pages only where a query yet to run reads.

Layers 0 and 2 have a window of 10 tokens, layer 1 attends to everything; pages of 4 tokens,
2 KV heads. A query at p of a window layer reads keys p - 9 .. p.
"""

import pytest
import torch

from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.window import LayerWindows

S, W, HEADS = 4, 10, 2
WINDOWS = (W, None, W)


def _kv(num_pages=200, max_len=64, windows=WINDOWS, max_seqs=2):
    return KVCacheManager(
        num_layers=len(windows), num_kv_heads=HEADS, head_dim=8, page_size=S, num_pages=num_pages,
        max_seqs=max_seqs, max_model_len=max_len, dtype=torch.float32, layer_windows=windows,
    )


def _layer_page_ids(kv, rid, layer):
    """Logical page -> the page id of (layer, head 0), None where it holds no page."""
    row = kv.table.table[kv.table.row(rid), layer, 0, : kv.table.num_logical_pages(rid)].tolist()
    return [None if pid == kv.table.no_page else pid for pid in row]


@pytest.mark.parametrize("num_tokens, first_page", [(20, 2), (21, 2), (22, 3)])
def test_a_window_layer_gets_pages_from_the_one_its_last_query_reads(num_tokens, first_page):
    # The last query (num_tokens - 1) reads from key num_tokens - 10: 21 tokens read key 11
    # (page 2), 22 tokens key 12 (page 3).
    kv = _kv()
    kv.allocate("a", num_tokens)
    pages = -(-num_tokens // S)
    assert kv.num_layer_pages("a") == [pages - first_page, pages, pages - first_page]
    assert _layer_page_ids(kv, "a", 0)[:first_page] == [None] * first_page
    assert None not in _layer_page_ids(kv, "a", 0)[first_page:]
    assert kv.num_free_pages == 200 - HEADS * (pages + 2 * (pages - first_page))
    kv.check_integrity()


def test_commit_frees_exactly_the_pages_behind_every_later_query():
    kv = _kv()
    kv.allocate("a", 20)  # window layers: pages 2 .. 4 (positions 8 .. 19)
    held = _layer_page_ids(kv, "a", 2)
    kv.commit("a", 20, None)  # the next query (20) reads key 11: page 2 stays
    assert _layer_page_ids(kv, "a", 2) == held and kv.num_layer_pages("a") == [3, 5, 3]
    free = kv.num_free_pages
    kv.allocate("a", 21)
    assert kv.num_free_pages == free - HEADS * 3  # page 5 for all three layers
    free = kv.num_free_pages
    kv.commit("a", 21, None)  # the next query (21) reads key 12 on: page 2 goes, in both window layers
    assert kv.num_free_pages == free + HEADS * 2
    assert _layer_page_ids(kv, "a", 2)[:4] == [None, None, None, held[3]]
    assert kv.num_layer_pages("a") == [3, 6, 3]
    kv.check_integrity()
    # the freed ids are the ones the next page takes
    freed = {held[2], held[2] + 1}  # head 0 and head 1 of layer 2 sat next to each other
    kv.allocate("b", 1)
    assert freed <= set(kv.table.host_pages("b")[0])
    kv.check_integrity()


def test_decoding_a_long_sequence_holds_at_most_a_window_of_pages_per_window_layer():
    kv = _kv(num_pages=300, max_len=400)
    bound = -(-W // S) + 1
    kv.allocate("a", 30)  # a prompt in one step
    kv.commit("a", 30, None)
    for n in range(31, 400):  # one decode step each: position n - 1
        kv.allocate("a", n)
        assert max(kv.num_layer_pages("a")[0::2]) <= bound
        kv.commit("a", n, None)
        kv.check_integrity()
    window, full = kv.num_layer_pages("a")[0], kv.num_layer_pages("a")[1]
    assert window <= bound and full == 100
    # what it holds: 100 pages of the full layer, the window's of the others
    assert kv.num_free_pages == 300 - HEADS * (100 + 2 * window)
    kv.free("a")
    assert kv.num_free_pages == 300
    kv.check_integrity()


def test_chunked_prefill_keeps_the_window_before_each_chunk_until_it_ran():
    kv = _kv(max_len=400)
    peak = kv.windows.most_pages(400) - kv.windows.num_full_layers * 100  # both window layers
    for end in range(24, 200, 24):  # chunks of 24 tokens
        kv.allocate("a", end)
        if end > 24:  # a later chunk's first query (end - 24) reads from key end - 33: still held
            assert _layer_page_ids(kv, "a", 0)[(end - 24 - W + 1) // S] is not None
        assert sum(kv.num_layer_pages("a")[0::2]) <= peak
        kv.commit("a", end, None)
        assert kv.num_layer_pages("a")[0] <= -(-W // S) + 1
        kv.check_integrity()


def test_can_allocate_counts_a_window_layers_pages_by_its_window():
    # 200 tokens: the full layer needs 50 pages a head; each window layer 3 (the last query
    # reads keys 190 .., pages 47 .. 49)
    kv = _kv(num_pages=HEADS * (50 + 2 * 3), max_len=256)
    assert kv.can_allocate("a", 200)
    assert not kv.can_allocate("a", 201)  # a 51st page of the full layer
    kv.allocate("a", 200)
    assert kv.num_free_pages == 0
    assert kv.pages_for_tokens(200) == HEADS * (50 + 2 * 2 * (-(-W // S) + 1))
    no_windows = _kv(windows=(None, None, None))
    assert no_windows.pages_for_tokens(200) == HEADS * 3 * 50


def test_free_and_refree_after_preemption_return_every_page_once():
    kv = _kv(max_len=200)
    for end in (40, 80, 81, 82, 83):
        kv.allocate("a", end)
        kv.commit("a", end, None)
    kv.allocate("b", 50)
    kv.free("a")  # preempted: every page it still holds, once
    kv.check_integrity()
    kv.allocate("a", 83)  # recomputed in one step
    kv.commit("a", 83, None)
    kv.free("b")
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_pages == kv.num_total_pages == 200


def test_prefix_caching_is_refused_with_window_layers():
    with pytest.raises(ValueError, match="sliding-window"):
        KVCacheManager(num_layers=3, num_kv_heads=HEADS, head_dim=8, page_size=S, num_pages=50, max_seqs=1,
                       max_model_len=64, dtype=torch.float32, layer_windows=WINDOWS, enable_prefix_caching=True)


def test_layer_windows_group_layers_and_count_new_pages():
    lw = LayerWindows.of((8, None, 8, 16), 4, S)
    assert lw.groups == ((8, (0, 2)), (16, (3,))) and lw.num_full_layers == 1
    # 0 -> 24 tokens (6 pages; last query 23): window 8 from page 4, window 16 from page 2
    assert lw.num_new_pages(0, 24) == 6 + 2 * 2 + 4
    assert lw.new_page_layers(3, 24) == [[False, True, False, True], [True, True, True, True],
                                         [True, True, True, True]]
    assert LayerWindows.of((), 4, S).num_new_pages(1, 9) == 4 * 2
