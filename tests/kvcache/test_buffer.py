"""The GPU buffer's lookup on tiny shares: exact columns, victims and counters."""

import torch

from spin_cluster.kvcache.buffer import GpuBuffer


def _buf(share=4, slots=64):
    b = GpuBuffer(slots, page_size=2, head_dim=4, num_layers=1, num_kv_heads=1, max_seqs=2,
                  max_share=share, dtype=torch.float32, device="cpu", num_buckets=8)
    b.attach(0, share)
    return b


def _look(b, pages, now):
    want = torch.tensor([[pages + [-1] * (4 - len(pages))]])
    lookup, miss = b.lookup(torch.tensor([0]), 0, want, now)
    return lookup, miss[0, 0, : len(pages)].tolist()


def test_misses_fill_empty_columns_then_hits_keep_them():
    b = _buf()
    slots = b.res_slot[0, 0, 0].tolist()  # the share's 4 slots, column order
    lookup, miss = _look(b, [10, 11], now=1)
    assert miss == [True, True]
    assert lookup.slots[0, 0, :2].tolist() == slots[:2]  # oldest (empty) columns, lowest first
    assert lookup.miss_dst.tolist()[:2] == slots[:2] and lookup.miss_dst.tolist()[2:] == [-1, -1]
    lookup, miss = _look(b, [11, 12], now=2)
    assert miss == [False, True]
    assert lookup.slots[0, 0, :2].tolist() == [slots[1], slots[2]]
    assert b.res_page[0, 0, 0].tolist() == [10, 11, 12, -1]
    assert b.counters.tolist() == [4, 1, 3, 0]


def test_lru_victim_is_the_least_recently_used_unselected_page():
    b = _buf()
    slots = b.res_slot[0, 0, 0].tolist()
    _look(b, [1, 2, 3, 4], now=1)  # columns 0..3 hold pages 1..4
    _look(b, [1, 3], now=2)
    _look(b, [3], now=3)
    # Unselected now: 1 (used at 2), 2 (at 1), 4 (at 1). Two misses take 2 then 4 (same
    # bucket: lower column first); page 1, used more recently, stays.
    lookup, miss = _look(b, [3, 7, 8], now=4)
    assert miss == [False, True, True]
    assert lookup.slots[0, 0, :3].tolist() == [slots[2], slots[1], slots[3]]
    assert b.res_page[0, 0, 0].tolist() == [1, 7, 3, 8]
    assert b.counters[3].item() == 2  # two cached pages evicted


def test_shares_are_elastic_and_freed():
    b = GpuBuffer(24, 2, 4, 1, 2, max_seqs=4, max_share=6, dtype=torch.float32, device="cpu")
    # 24 slots / 2 heads = 12 columns free: alone a request gets its max share of 6...
    assert b.share_for(mandatory=2, num_waiting=0) == 6
    # ... with two more waiting, an equal part of every slot (12 / 3 = 4)
    assert b.share_for(mandatory=2, num_waiting=2) == 4
    assert b.share_for(mandatory=2, num_waiting=2, elastic=False) == 6  # fixed shares
    b.attach(0, 6)
    b.attach(1, 4)
    assert b.num_free_slots == 4
    assert b.share_for(mandatory=2, num_waiting=0, elastic=False) == 0
    # A third request's equal part is 4 columns: row 0's share of 6 would give back 2 of them.
    assert b.floor_share(mandatory=2, num_waiting=0) == 4
    assert b.share_for(mandatory=2, num_waiting=0) == 4
    assert b.share_for(mandatory=5, num_waiting=0) == 0  # its mandatory pages would need 10 of 8: wait
    b.make_room(b.slots_for(4), floor=4)
    assert (b.share_of(0), b.share_of(1), b.num_free_slots) == (4, 4, 8)
    b.attach(2, 4)
    b.check_integrity({0, 1, 2})
    assert b.share_for(mandatory=2, num_waiting=0) == 3  # 6 slots reclaimable down to 3 columns each
    # A request leaves: the others grow into its slots, up to an equal part (6 columns) each.
    b.detach(0)
    b.spread_free()
    assert (b.share_of(1), b.share_of(2), b.num_free_slots) == (6, 6, 0)
    b.check_integrity({1, 2})


def test_shrink_keeps_the_most_recently_used_pages_and_frees_the_rest():
    b = _buf(share=4)
    slots = b.res_slot[0, 0, 0].tolist()
    _look(b, [1, 2, 3], now=1)  # columns 0..2 hold pages 1..3, column 3 stays empty
    _look(b, [2], now=2)
    _look(b, [3], now=3)
    b.shrink(0, 2)  # keeps page 3 (used at 3) and page 2 (at 2); page 1 and the empty column go
    assert b.res_page[0, 0, 0].tolist() == [3, 2, -1, -1]
    assert b.res_slot[0, 0, 0].tolist() == [slots[2], slots[1], -1, -1]
    assert b.res_last_use[0, 0, 0, :2].tolist() == [3, 2]
    assert b.num_free_slots == 64 - 2 and b.share_of(0) == 2
    b.check_integrity({0})
    lookup, miss = _look(b, [2, 3, 1], now=4)  # held pages still hit; page 1 was forgotten
    assert miss == [False, False, True]
    b.grow(0, 4)
    assert (b.res_slot[0, 0, 0] >= 0).tolist() == [True, True, True, True] and b.num_free_slots == 60
    b.check_integrity({0})


def _ragged(slots=64, max_seqs=2):
    # One layer, three heads: full widths 8, 4, 2 columns; mandatory 4, 2, 1 pages.
    return GpuBuffer(slots, 2, 4, 1, 3, max_seqs=max_seqs, max_share=8, dtype=torch.float32, device="cpu",
                     num_buckets=8, head_widths=[[8, 4, 2]], head_mandatory=[[4, 2, 1]])


def test_per_head_widths_give_each_head_its_own_columns():
    b = _ragged()
    assert b.per_head_widths and b.widths(8).tolist() == [[8, 4, 2]]
    assert b.widths(4).tolist() == [[4, 2, 1]]  # half the share: half of every head, >= mandatory
    assert (b.slots_for(8), b.slots_for(4)) == (14, 7)
    b.attach(0, 8)
    held = (b.res_slot[0, 0] >= 0).sum(-1).tolist()
    assert held == [8, 4, 2] and b.num_free_slots == 64 - 14 and b.share_of(0) == 8
    b.check_integrity({0})
    # Head 2 selects a new page every step: its misses cycle through its own 2 columns and
    # never touch a column past its width.
    for now in range(1, 7):
        want = torch.tensor([[[now, -1], [now, -1], [100 + now, -1]]])
        lookup, miss = b.lookup(torch.tensor([0]), 0, want, now)
        assert miss[:, :, 0].all()
        assert lookup.slots[0, 2, 0].item() in b.res_slot[0, 0, 2, :2].tolist()
    assert b.res_page[0, 0, 2, 2:].tolist() == [-1] * 6 and b.res_page[0, 0, 2, :2].tolist() == [105, 106]
    assert b.res_page[0, 0, 0, :6].tolist() == [1, 2, 3, 4, 5, 6]  # the wide head keeps all six
    b.check_integrity({0})
    b.detach(0)
    assert b.num_free_slots == 64 and b.share_of(0) == 0


def test_per_head_widths_make_elastic_shares_in_slots():
    b = _ragged(slots=22, max_seqs=4)
    assert b.share_for(mandatory=4, num_waiting=0) == 8  # 14 slots of 22
    assert b.share_for(mandatory=4, num_waiting=1) == 6  # within 11 slots: widths 6, 3, 2
    assert (b.slots_for(6), b.slots_for(7)) == (11, 13)
    assert b.share_for(mandatory=4, num_waiting=3) == 4  # the mandatory share (7 slots), above 22 / 4
    b.attach(0, 8)
    # An equal part of 22 slots for two is 11 (share 6): 8 are free, row 0 gives back 3.
    assert b.share_for(mandatory=4, num_waiting=0) == 6
    assert b.share_for(mandatory=4, num_waiting=0, elastic=False) == 0
    b.make_room(b.slots_for(6), b.floor_share(mandatory=4, num_waiting=0))
    assert b.share_of(0) == 6 and b.num_free_slots == 11
    b.attach(1, 6)
    b.check_integrity({0, 1})
    assert b.share_for(mandatory=4, num_waiting=0) == 4  # 7 slots: each share gives back 4
    assert b.slots_for(5) == 10 and b.share_for(mandatory=5, num_waiting=0) == 0  # 2 reclaimable: wait


def test_per_head_widths_are_checked():
    import pytest

    kw = dict(num_slots=8, page_size=2, head_dim=4, num_layers=1, num_kv_heads=2, max_seqs=1, max_share=4,
              dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="go together"):
        GpuBuffer(**kw, head_widths=[[4, 2]])
    with pytest.raises(ValueError, match=r"\[1\]\[2\]"):
        GpuBuffer(**kw, head_widths=[[4, 2, 1]], head_mandatory=[[2, 1, 1]])
    with pytest.raises(ValueError, match="the widest 4"):
        GpuBuffer(**kw, head_widths=[[3, 2]], head_mandatory=[[2, 1]])
    with pytest.raises(ValueError, match="mandatory"):
        GpuBuffer(**kw, head_widths=[[4, 1]], head_mandatory=[[2, 2]])


def test_grow_gives_each_head_its_new_columns_in_order_without_touching_the_rest():
    # Two layers, three heads of ragged widths; a share grown twice must equal the block a
    # mask of the new columns gives (each head's columns past its old width, in layer, head,
    # column order), keep the columns it had, and leave the other rows alone.
    b = GpuBuffer(64, 2, 4, 2, 3, max_seqs=2, max_share=8, dtype=torch.float32, device="cpu", num_buckets=8,
                  head_widths=[[8, 4, 2], [6, 8, 3]], head_mandatory=[[4, 2, 1], [3, 4, 1]])
    b.attach(0, 2)
    b.attach(1, 2)
    other = b.res_slot[1].clone()
    for old, share in ((2, 5), (5, 8)):
        before = b.res_slot[0].clone()
        free_before = b._free_slots.ids()
        b.grow(0, share)
        cols = torch.arange(8)
        new = (cols < b.widths(share)[..., None]) & ~(cols < b.widths(old)[..., None])
        taken = free_before[::-1][: int(new.sum())]  # the lowest free ids, in take's order
        want = before.clone()
        want[new] = torch.tensor(taken, dtype=torch.int32)
        assert torch.equal(b.res_slot[0], want)
        assert (b.res_slot[0] >= 0).sum(-1).tolist() == b.widths(share).tolist()
    assert torch.equal(b.res_slot[1], other)
    b.check_integrity({0, 1})


def test_shrinking_several_shares_at_once_equals_shrinking_them_one_by_one():
    # Ragged head widths, shares filled by lookups at different times (so that each head keeps
    # its most recent columns): the batched shrink keeps and frees exactly what per-row
    # shrinks in the same order do, the free list included.
    def filled():
        b = GpuBuffer(96, 2, 4, 2, 3, max_seqs=3, max_share=8, dtype=torch.float32, device="cpu", num_buckets=8,
                      head_widths=[[8, 4, 2], [6, 8, 3]], head_mandatory=[[4, 2, 1], [3, 4, 1]])
        g = torch.Generator().manual_seed(0)
        for row in range(3):
            b.attach(row, 8)
            for now in range(1, 5):
                want = torch.randperm(20, generator=g)[:6].view(1, 1, 6).expand(1, 3, 6).clone()
                want[:, 2, 2:] = -1
                b.lookup(torch.tensor([row]), now % 2, want, now + 4 * row)
        return b

    one, together = filled(), filled()
    one.shrink(2, 5)
    one.shrink(0, 3)
    together._shrink_rows({2: 5, 0: 3})
    for name in ("res_slot", "res_page", "res_last_use"):
        assert torch.equal(getattr(one, name), getattr(together, name)), name
    assert one._free_slots.ids() == together._free_slots.ids()
    assert (together.share_of(0), together.share_of(1), together.share_of(2)) == (3, 8, 5)
    together.check_integrity({0, 1, 2})


def test_make_room_frees_what_it_needs_from_the_widest_shares_down_to_the_floor():
    b = _ragged(slots=64, max_seqs=4)
    for row in range(4):
        b.attach(row, 8 if row < 3 else 4)  # 14 + 14 + 14 + 7 slots of 64: 15 free
    b.make_room(30, floor=4)  # 15 more: rows 0 and 1 to the floor (7 each), row 2 to 7 columns (13 slots)
    assert b.num_free_slots == 30
    assert [b.share_of(r) for r in range(4)] == [4, 4, 7, 4]
    b.check_integrity({0, 1, 2, 3})
