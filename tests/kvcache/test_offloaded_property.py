"""Random sequences of allocate / append / select+retrieve / evict / abort on the offloaded
cache (elastic shares shrink on admissions and grow on releases); after every step the integrity check passes and every selected page's slot holds
exactly that page's host data."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spin_cluster.kernels.retrieve import retrieve_pages_ref
from spin_cluster.kvcache.offloaded import OffloadedKVManager

L, HKV, S, E, D = 2, 2, 2, 2, 4
SHARE, MANDATORY = 4, 3


def _manager():
    kv = OffloadedKVManager(
        num_layers=L, num_kv_heads=HKV, head_dim=D, page_size=S, segment_pages=E,
        num_host_segments=24, num_buffer_slots=40, buffer_pages_per_head=SHARE,
        mandatory_pages_per_head=MANDATORY, max_seqs=4, max_model_len=32, dtype=torch.float32,
        device="cpu", num_buckets=4,
    )
    # Every host page holds its own id, so a slot's content names the page it caches.
    ids = torch.arange(kv.host.k_pages.shape[0], dtype=torch.float32)
    kv.host.k_pages[:] = ids[:, None, None]
    kv.host.v_pages[:] = -ids[:, None, None]
    return kv


op = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 12)),
    st.tuples(st.just("select"), st.integers(0, 5), st.integers(0, 2**16)),
    st.tuples(st.just("abort"), st.integers(0, 5), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=30))
def test_random_operations_keep_the_cache_consistent(ops):
    kv = _manager()
    tokens: dict[str, int] = {}
    now = 0
    for name, rid_i, arg in ops:
        rid = f"r{rid_i}"
        if name == "grow":
            want = min(32, tokens.get(rid, 0) + arg)
            queued = arg % 3  # requests waiting behind a newcomer: smaller elastic shares
            if kv.can_allocate(rid, want, queued):
                kv.allocate(rid, want, queued)
                tokens[rid] = want
        elif name == "abort":
            kv.free(rid)
            tokens.pop(rid, None)
        elif rid in tokens:
            now += 1
            _select_and_retrieve(kv, rid, tokens[rid], arg, now)
        kv.check_integrity()
    for rid in list(tokens):
        kv.free(rid)
    kv.check_integrity()
    assert kv.num_free_pages == kv.num_total_pages and kv.buffer.num_free_slots == kv.buffer.num_slots


def _select_and_retrieve(kv, rid, num_tokens, seed, now):
    g = torch.Generator().manual_seed(seed)
    layer = int(torch.randint(L, (1,), generator=g))
    num_pages = -(-num_tokens // S)
    row = torch.tensor([kv.row(rid)])
    want = torch.full((1, HKV, MANDATORY), -1, dtype=torch.long)
    for h in range(HKV):
        k = int(torch.randint(1, min(MANDATORY, num_pages) + 1, (1,), generator=g))
        want[0, h, :k] = torch.randperm(num_pages, generator=g)[:k]
    lookup, miss = kv.buffer.lookup(row, layer, want, now)
    src = torch.where(miss.view(-1), kv.directory.host_pages(row, layer, want).view(-1), -1)
    b = kv.buffer
    retrieve_pages_ref(kv.host.k_pages, kv.host.v_pages, b.k_slots, b.v_slots, src, lookup.miss_dst)
    host = kv.directory.host_pages(row, layer, want)
    valid = want >= 0
    got = b.k_slots[lookup.slots.long()][..., 0, 0]  # [1, Hkv, K] page id stored in the slot
    assert torch.equal(got[valid], host[valid].float())
    assert torch.equal(b.v_slots[lookup.slots.long()][..., 0, 0][valid], -host[valid].float())


def test_metadata_bytes_directory_is_a_segment_fraction_of_a_flat_table():
    kv = _manager()
    m = kv.metadata_bytes()
    # flat: 5 rows (4 requests' and the padding row) x 2 layers x 2 heads x 16 pages x 4 B;
    # directory: 16 pages / E=2 segments
    assert m["flat_gpu"] == 5 * 2 * 2 * 16 * 4
    assert m["gpu"] == m["flat_gpu"] // E
    kv.allocate("a", 5)  # 3 pages -> 2 segments per (layer, head)
    assert kv.metadata_bytes()["host"] == 2 * L * HKV * 4
    kv.allocate("b", 1)  # 1 page -> 1 segment per (layer, head)
    assert kv.metadata_bytes()["host"] == 3 * L * HKV * 4 == len(kv.directory.owned_segment_ids()) * 4
    kv.free("a")
    assert kv.metadata_bytes()["host"] == 1 * L * HKV * 4
