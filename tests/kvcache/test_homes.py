"""The GPU and the host as one KV capacity: pages born on the GPU, spilled to the host coldest
first when the GPU is full, and retrieved into buffer slots when Select picks them."""

import pytest
import torch

from spin_cluster.kvcache.offloaded import OffloadedKVManager
from spin_cluster.kvcache.transfer import Transfer

S, D = 2, 4


def _manager(num_host=4, num_gpu=3, num_kv_heads=1, slots=8, share=4, mandatory=3):
    # Segments of one page: a segment id names one page, and the tests name pages exactly.
    return OffloadedKVManager(
        num_layers=1, num_kv_heads=num_kv_heads, head_dim=D, page_size=S, segment_pages=1,
        num_host_segments=num_host, num_buffer_slots=slots, buffer_pages_per_head=share,
        mandatory_pages_per_head=mandatory, max_seqs=4, max_model_len=16, dtype=torch.float32,
        device="cpu", num_buckets=4, num_gpu_segments=num_gpu,
    )


def _segments(kv, rid):
    """[logical segment] -> segment id, layer 0 head 0."""
    return [group[0] for group in kv.directory.host_mirror(rid)]


def _stamp(kv, gpu_slots, step):
    """What the lookup kernel does for the pages Select picked: stamp their GPU segments
    (GPU page array slots) with the step, the spill order's recency."""
    homes = kv.homes
    base = homes.first_gpu_page + homes.gpu_slot_offset  # the slot of GPU page 0
    for slot in gpu_slots:
        homes.gpu_last_use[(slot - base) // homes.segment_pages] = step


def _write_page_ids(kv, rid, num_pages):
    """Write each page's (request-unique) id into its home: K = 100 * row + page, V = -K."""
    row = kv.row(rid)
    for p in range(num_pages):
        page = int(kv.directory.host_pages(torch.tensor([row]), 0, torch.tensor([[[p]]]))[0, 0, 0])
        value = 100 * row + p
        slot = int(kv.homes.gpu_slots(torch.tensor(page)))
        k, v = (kv.buffer.k_slots, kv.buffer.v_slots) if slot >= 0 else (kv.host.k_pages, kv.host.v_pages)
        at = slot if slot >= 0 else page
        k[at], v[at] = value, -value


def test_pages_are_born_on_the_gpu_then_on_the_host_when_it_is_full():
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)  # 3 pages: the 3 GPU segments (ids 4, 5, 6 after the 4 host ones)
    assert _segments(kv, "a") == [4, 5, 6]
    assert kv.tier_pages() == {"gpu": (3, 3), "host": (0, 4)}
    assert kv.num_free_pages == 4 and kv.num_total_pages == 7
    kv.check_integrity()


def test_a_full_gpu_spills_its_coldest_page_to_the_host_and_the_newcomer_is_born_on_the_gpu():
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)  # pages 0, 1, 2 of a: GPU segments 4, 5, 6 (slots 8, 9, 10 after 8 buffer slots)
    _write_page_ids(kv, "a", 3)
    # Select picked pages 0 and 2 at step 5: page 1 is the coldest.
    _stamp(kv, [8, 10], 5)
    kv.allocate("b", 2)
    assert _segments(kv, "a") == [4, 0, 6]  # page 1 now lives in host segment 0
    assert _segments(kv, "b") == [5]  # born on the GPU, in the segment page 1 left
    assert kv.num_spilled_segments == 1
    assert kv.host.k_pages[0, 0, 0] == 100 * kv.row("a") + 1 and kv.host.v_pages[0, 0, 0] == -(100 * kv.row("a") + 1)
    kv.check_integrity()


def test_ties_spill_the_lowest_row_layer_head_and_segment_first():
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)
    kv.allocate("b", 4)  # GPU full: 2 of a's pages spill (no step has run: all equally cold)
    assert _segments(kv, "a") == [0, 1, 6] and _segments(kv, "b") == [4, 5]
    kv.check_integrity()


def test_a_spilled_page_comes_back_through_the_buffer_and_gpu_pages_are_read_in_place():
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)
    _write_page_ids(kv, "a", 3)
    _stamp(kv, [8, 10], 5)
    kv.allocate("b", 2)  # page 1 of a spills to host page 0
    t = Transfer(kv.homes, torch.device("cpu"), kv.buffer, kv.directory)
    rows = torch.tensor([kv.row("a")])
    want = torch.tensor([[[0, 1, 2]]])
    new = torch.zeros(1, D)
    slots, lens = t.retrieve(rows, 0, want, torch.tensor([[3]]), torch.tensor([2]), torch.tensor([6]), new, new)
    # Pages 0 and 2 at their GPU homes (slots 8 and 10); page 1 in a buffer slot (the first free: 0).
    assert slots.tolist() == [[[8, 0, 10]]]
    assert lens.tolist() == [[6]]
    base = 100 * kv.row("a")
    assert kv.buffer.k_slots[0, 0, 0] == base + 1 and kv.buffer.k_slots[8, 0, 0] == base
    lookups, hits, misses, _ = kv.buffer.counters.tolist()
    assert (lookups, hits, misses) == (1, 0, 1)  # the buffer sees the host page only
    # The GPU pages read this step carry its stamp (the spill order's recency).
    assert kv.homes.gpu_last_use[[0, 2]].tolist() == [6, 6]


def test_a_spill_written_a_page_per_launch_moves_every_page(monkeypatch):
    # A long chunk's allocation spills more pages than one write launch takes: each goes to
    # its own host page all the same.
    monkeypatch.setattr(OffloadedKVManager, "SPILL_PAGES_PER_WRITE", 1)
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)
    _write_page_ids(kv, "a", 3)
    kv.allocate("b", 6)  # GPU full: all three of a's pages spill, one launch each
    assert _segments(kv, "a") == [0, 1, 2]
    row = kv.row("a")
    assert kv.host.k_pages[:3, 0, 0].tolist() == [100 * row + p for p in range(3)]
    assert kv.host.v_pages[:3, 0, 0].tolist() == [-(100 * row + p) for p in range(3)]
    kv.check_integrity()


def test_spilling_stops_when_the_host_is_full_and_admission_counts_both_tiers():
    kv = _manager(num_host=1, num_gpu=2)
    assert kv.can_allocate("a", 6)  # 3 pages of 3
    kv.allocate("a", 6)
    assert not kv.can_allocate("b", 2)  # both tiers full: the newcomer waits
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_pages == kv.num_total_pages == 3


def test_no_host_tier_is_the_same_cache_with_zero_host_segments():
    kv = _manager(num_host=0, num_gpu=4)
    kv.allocate("a", 8)
    assert _segments(kv, "a") == [0, 1, 2, 3]  # GPU ids start at 0 when the host has none
    assert kv.spill(1) == []  # nowhere to spill
    assert not kv.can_allocate("b", 2)
    kv.check_integrity()


def test_an_empty_host_tier_needs_gpu_homes():
    with pytest.raises(ValueError, match="host_kv_gib"):
        _manager(num_host=0, num_gpu=0)


def test_on_gpu_names_the_pages_at_home_on_the_gpu():
    kv = _manager(num_gpu=3)
    kv.allocate("a", 6)
    _stamp(kv, [8, 10], 5)
    kv.allocate("b", 2)  # page 1 of a spills
    table = kv.directory.directory[kv.row("a"), 0]  # [Hkv, n_seg]
    assert kv.homes.on_gpu(table, 4).tolist() == [[True, False, True, False]]  # page 3: not allocated


def test_the_padding_row_is_a_one_token_request_of_its_own_outside_the_requests():
    """``padding_row``: the row past max_seqs' with one page (taken once, kept) and one buffer
    column of its own, listed by no request API; the max_seqs requests' rows, shares and
    capacity are as without it, and spilling may move its page like any other."""
    kv = _manager(num_host=10, num_gpu=3, num_kv_heads=2, slots=24)
    assert kv.padding_row() == kv.padding_row() == 4  # max_seqs=4: row 4
    assert kv.request_ids() == [] and kv.num_free_pages == 11  # one segment a head (2) of 13
    pad_slots = kv.buffer.res_slot[4, 0, :, 0].tolist()
    assert pad_slots == [24 + 3, 24 + 3 + 1]  # after the 24 buffer slots and the 3 home pages
    assert (kv.buffer.res_slot[4, :, :, 1:] == -1).all()
    assert kv.buffer.num_free_slots == kv.buffer.num_slots == 24  # no buffer slot of the shares'
    for i in range(4):
        assert kv.can_allocate(f"r{i}", 2)
        kv.allocate(f"r{i}", 1)
    assert [kv.row(f"r{i}") for i in range(4)] == [0, 1, 2, 3]
    assert not kv.can_allocate("r4", 1)  # still max_seqs requests
    kv.check_integrity()
    kv.allocate("r0", 4)  # more pages than the GPU has free: the coldest segments spill
    kv.check_integrity()
    for i in range(4):
        kv.free(f"r{i}")
    assert kv.request_ids() == [] and kv.padding_row() == 4
    assert kv.buffer.num_free_slots == kv.buffer.num_slots
    kv.check_integrity()
    kv.buffer.res_slot[4, 0, 1, 0] = 0  # a share that lost its own slot is caught
    with pytest.raises(AssertionError, match="padding row"):
        kv.check_integrity()
