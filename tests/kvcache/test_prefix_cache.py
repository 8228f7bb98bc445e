"""Prefix caching in the GPU-only cache: which pages are shared, their holders, the LRU of idle
pages, capacity and integrity. One logical page = 2 physical pages (1 layer x 2 KV heads) of
4 tokens, so the pool hands out [0, 1], [2, 3], ... in order."""

import pytest
import torch

from spin_cluster.kvcache.base import NO_PREFIX
from spin_cluster.kvcache.manager import KVCacheManager
from spin_cluster.kvcache.prefix_cache import ChainKey


def _kv(num_pages=20, prefix_caching=True, max_len=32):
    return KVCacheManager(
        num_layers=1, num_kv_heads=2, head_dim=4, page_size=4, num_pages=num_pages, max_seqs=4,
        max_model_len=max_len, dtype=torch.float32, enable_prefix_caching=prefix_caching,
    )


def _admit(kv, rid, tokens):
    """Admit with the cached pages of every token but the last (the scheduler's rule); the
    tokens the hit covers."""
    hit = kv.match_prefix(tokens[:-1])
    assert kv.can_allocate(rid, len(tokens), prefix=hit)
    kv.allocate(rid, len(tokens), prefix=hit)
    return hit.num_tokens


def _written(kv, rid, tokens):
    """The model wrote the K/V of ``tokens``."""
    kv.commit(rid, len(tokens), lambda start, stop: tokens[start:stop])


def _idle(kv):
    return [page.page_ids for page in kv.prefixes._idle.values()]


def test_a_request_reuses_the_full_pages_another_published():
    kv = _kv()
    a = list(range(1, 11))
    assert _admit(kv, "a", a) == 0
    _written(kv, "a", a)  # pages 1-4 and 5-8 are full: published; 9-10 is not
    b = list(range(1, 9)) + [50, 51, 52]
    assert _admit(kv, "b", b) == 8
    assert kv.table.host_pages("b") == [[0, 1], [2, 3], [6, 7]]
    assert kv.num_free_pages == 20 - 8
    kv.check_integrity()
    kv.free("a")  # its partial page goes back to the pool; b still holds the shared two
    assert kv.num_free_pages == 20 - 6 and _idle(kv) == []
    kv.free("b")
    assert kv.num_free_pages == 20 and kv.pool.num_free == 16 and _idle(kv) == [[2, 3], [0, 1]]
    kv.check_integrity()


def test_only_full_pages_are_shared():
    kv = _kv()
    a = list(range(1, 8))
    _admit(kv, "a", a)
    _written(kv, "a", a)  # 7 tokens: one full page
    assert kv.match_prefix(a).num_tokens == 4
    assert kv.match_prefix([1, 2, 3]) is NO_PREFIX  # shorter than a page
    assert kv.match_prefix([1, 2, 3, 5]) is NO_PREFIX
    a.append(8)
    kv.allocate("a", 8)
    _written(kv, "a", a)  # the second page is full now
    hit = kv.match_prefix(a + [9])
    assert hit.num_tokens == 8 and [p.page_ids for p in hit.pages] == kv.table.host_pages("a")
    kv.check_integrity()


def test_the_same_tokens_at_another_position_do_not_match():
    kv = _kv()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _admit(kv, "a", a)
    _written(kv, "a", a)
    assert kv.match_prefix([5, 6, 7, 8, 9]) is NO_PREFIX  # a's second page, but first here
    assert kv.match_prefix([9, 9, 9, 9, 5, 6, 7, 8]) is NO_PREFIX  # after another first page


def test_a_page_written_twice_stays_private_to_the_later_request():
    kv = _kv()
    a, b = list(range(1, 9)), list(range(1, 13))
    _admit(kv, "a", a)
    _admit(kv, "b", b)  # admitted before a's pages were written: no hit
    _written(kv, "a", a)
    _written(kv, "b", b)  # its first two pages duplicate a's; its third chains on a's second
    hit = kv.match_prefix(b + [13])
    assert [p.page_ids for p in hit.pages] == [[0, 1], [2, 3], [8, 9]]
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.prefixes.num_published == 3 and kv.pool.num_free == 20 - 6
    kv.check_integrity()


def _two_idle_chains(kv):
    """Requests a and b of two full pages each, written and freed, a first: their tokens."""
    a, b = list(range(1, 9)), list(range(101, 109))
    for rid, tokens in (("a", a), ("b", b)):
        _admit(kv, rid, tokens)
        _written(kv, rid, tokens)
    kv.free("a")
    kv.free("b")
    return a, b


def test_idle_pages_are_evicted_least_recently_released_first_and_a_chains_tail_first():
    kv = _kv(num_pages=8)  # 4 logical pages
    a, b = _two_idle_chains(kv)
    assert _idle(kv) == [[2, 3], [0, 1], [6, 7], [4, 5]] and kv.pool.num_free == 0
    assert kv.num_free_pages == 8 and kv.free_token_capacity() == 16
    _admit(kv, "c", [201, 202, 203])  # evicts a's tail
    assert kv.table.host_pages("c") == [[2, 3]]
    assert kv.match_prefix(a).num_tokens == 4 and kv.match_prefix(b).num_tokens == 8
    _admit(kv, "d", [301, 302, 303])  # then a's head
    assert kv.table.host_pages("d") == [[0, 1]]
    assert kv.match_prefix(a) is NO_PREFIX and kv.match_prefix(b).num_tokens == 8
    kv.check_integrity()


def test_a_reused_page_goes_to_the_back_of_the_lru():
    kv = _kv(num_pages=10)  # a's 2 pages, b's 2, one free
    a, _ = _two_idle_chains(kv)
    assert _admit(kv, "e", a[:4] + [9]) == 4  # holds a's head again
    assert _idle(kv) == [[2, 3], [6, 7], [4, 5]]
    kv.free("e")  # e's own page (the free one) was never published: back to the pool
    assert _idle(kv) == [[2, 3], [6, 7], [4, 5], [0, 1]] and kv.pool.num_free == 2
    kv.check_integrity()


def test_capacity_counts_idle_pages_but_not_the_idle_pages_a_newcomer_takes():
    kv = _kv(num_pages=8)  # 4 logical pages
    a = list(range(1, 13))
    _admit(kv, "a", a)
    _written(kv, "a", a)
    kv.free("a")  # 3 idle pages, 1 free
    long_b = a[:8] + list(range(50, 62))  # 20 tokens = 5 pages: 2 hit, 3 new; only 2 others left
    hit = kv.match_prefix(long_b[:-1])
    assert hit.num_tokens == 8
    assert not kv.can_allocate("b", 20, prefix=hit)
    assert kv.can_allocate("b", 16, prefix=hit)  # 2 new: a's idle tail and the free one
    kv.allocate("b", 16, prefix=hit)
    assert kv.table.host_pages("b") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert kv.match_prefix(a).num_tokens == 8  # a's tail was evicted
    assert kv.num_free_pages == 0 and not kv.can_allocate("c", 1)
    kv.check_integrity()


def test_a_full_cache_of_idle_pages_admits_a_newcomer():
    kv = _kv(num_pages=8)
    a = list(range(1, 17))
    _admit(kv, "a", a)
    _written(kv, "a", a)
    kv.free("a")
    assert kv.pool.num_free == 0 and kv.num_free_pages == 8
    assert kv.can_allocate("b", 16)
    kv.allocate("b", 16)
    assert kv.prefixes.num_published == 0 and kv.num_free_pages == 0
    kv.check_integrity()


def test_integrity_holds_through_sharing_preemption_and_abort_and_catches_a_bad_refcount():
    kv = _kv()
    a = list(range(1, 14))
    _admit(kv, "a", a)
    _written(kv, "a", a)
    for rid in ("b", "c"):
        assert _admit(kv, rid, a) == 12
        kv.check_integrity()
    kv.free("b")  # preempted: its pages go on being shared by a and c
    kv.check_integrity()
    assert [kv.prefixes._id_to_page[p].refcount for p in (0, 2, 4)] == [2, 2, 2]
    kv.free("c")  # aborted
    kv.free("c")  # freeing twice is a no-op
    kv.check_integrity()
    kv.prefixes._id_to_page[0].refcount += 1
    with pytest.raises(AssertionError, match="refcount"):
        kv.check_integrity()


def test_integrity_catches_a_private_page_held_twice_and_an_idle_page_still_held():
    kv = _kv()
    _admit(kv, "a", [1, 2, 3])
    _admit(kv, "b", [5, 6, 7])
    kv.table._request_to_pages["b"][0] = [0, 1]  # a bug: b lists a's private page
    with pytest.raises(AssertionError, match="held by 2 rows"):
        kv.check_integrity()
    kv = _kv()
    a = list(range(1, 9))
    _admit(kv, "a", a)
    _written(kv, "a", a)
    page = kv.prefixes._id_to_page[0]
    page.refcount = 0
    kv.prefixes._idle[0] = page  # a bug: idle while a holds it
    with pytest.raises(AssertionError, match="refcount"):
        kv.check_integrity()


def test_without_prefix_caching_nothing_is_published():
    kv = _kv(prefix_caching=False)
    a = list(range(1, 10))
    _admit(kv, "a", a)
    _written(kv, "a", a)
    assert kv.prefixes.num_published == 0 and kv.match_prefix(a) is NO_PREFIX
    kv.free("a")
    assert kv.pool.num_free == 20
    kv.check_integrity()


def test_chain_keys_are_equal_only_for_equal_token_prefixes_whatever_their_hash():
    first, first_again = ChainKey(None, (1, 2)), ChainKey(None, (1, 2))
    assert first == first_again and hash(first) == hash(first_again)
    assert ChainKey(first, (3, 4)) == ChainKey(first_again, (3, 4))  # other objects, same tokens
    assert ChainKey(ChainKey(None, (9, 9)), (3, 4)) != ChainKey(first, (3, 4))
    assert ChainKey(None, (3, 4)) != ChainKey(first, (3, 4))  # another position
    forged = ChainKey(None, (7, 8))
    forged._hash = hash(first)  # a hash collision
    assert forged not in {first: "cached"}
