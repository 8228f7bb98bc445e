"""Random arrivals, growth, selections, spills, aborts and preemptions over a cache whose pages
live on the GPU and the host: after every operation no page is lost, duplicated or leaked
(the integrity check over both tiers and the buffer), and every page still holds what was
written into it, wherever it lives now."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spin_cluster.kvcache.offloaded import OffloadedKVManager
from spin_cluster.kvcache.transfer import Transfer

L, HKV, S, E, D = 2, 2, 2, 2, 4
SHARE, MANDATORY = 4, 3
MAX_LEN = 32


def _manager():
    return OffloadedKVManager(
        num_layers=L, num_kv_heads=HKV, head_dim=D, page_size=S, segment_pages=E,
        num_host_segments=10, num_buffer_slots=40, buffer_pages_per_head=SHARE,
        mandatory_pages_per_head=MANDATORY, max_seqs=4, max_model_len=MAX_LEN, dtype=torch.float32,
        device="cpu", num_buckets=4, num_gpu_segments=12,
    )


def _value(rid: str, layer: int, head: int, page: int) -> float:
    return float(int(rid[1:]) * 10000 + layer * 1000 + head * 100 + page)


def _home(kv, rid, layer, head, page):
    """(k pages, v pages, index) of a logical page's home."""
    row = torch.tensor([kv.row(rid)])
    want = torch.full((1, HKV, 1), -1, dtype=torch.long)
    want[0, head, 0] = page
    pid = int(kv.directory.host_pages(row, layer, want)[0, head, 0])
    slot = int(kv.homes.gpu_slots(torch.tensor(pid)))
    if slot >= 0:
        return kv.buffer.k_slots, kv.buffer.v_slots, slot
    return kv.host.k_pages, kv.host.v_pages, pid


def _write(kv, rid, first_page, last_page):
    for layer in range(L):
        for head in range(HKV):
            for p in range(first_page, last_page):
                k, v, i = _home(kv, rid, layer, head, p)
                k[i], v[i] = _value(rid, layer, head, p), -_value(rid, layer, head, p)


def _check_contents(kv, pages):
    for rid, n in pages.items():
        for layer in range(L):
            for head in range(HKV):
                for p in range(n):
                    k, v, i = _home(kv, rid, layer, head, p)
                    assert k[i, 0, 0] == _value(rid, layer, head, p), (rid, layer, head, p)
                    assert v[i, -1, -1] == -_value(rid, layer, head, p)


op = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 12)),
    st.tuples(st.just("select"), st.integers(0, 5), st.integers(0, 2**16)),
    st.tuples(st.just("spill"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("preempt"), st.integers(0, 5), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=30))
def test_random_operations_never_lose_duplicate_or_leak_a_page(ops):
    kv = _manager()
    transfer = Transfer(kv.homes, torch.device("cpu"), kv.buffer, kv.directory)
    tokens: dict[str, int] = {}
    order: list[str] = []  # arrival order, for preemption of the newest
    now = 0
    for name, rid_i, arg in ops:
        rid = f"r{rid_i}"
        if name == "grow":
            want = min(MAX_LEN, tokens.get(rid, 0) + arg)
            if kv.can_allocate(rid, want, arg % 3):
                before = -(-tokens.get(rid, 0) // S)
                kv.allocate(rid, want, arg % 3)
                tokens[rid] = want
                if rid not in order:
                    order.append(rid)
                _write(kv, rid, before, -(-want // S))
        elif name == "spill":
            kv.spill(arg)
        elif name in ("abort", "preempt"):
            victim = order[-1] if name == "preempt" and order else rid
            kv.free(victim)
            tokens.pop(victim, None)
            if victim in order:
                order.remove(victim)
        elif rid in tokens:
            now += 1
            _select(kv, transfer, rid, tokens[rid], arg, now)
        kv.check_integrity()
        _check_contents(kv, {r: -(-n // S) for r, n in tokens.items()})
    for rid in list(tokens):
        kv.free(rid)
    kv.check_integrity()
    assert kv.num_free_pages == kv.num_total_pages and kv.buffer.num_free_slots == kv.buffer.num_slots


def _select(kv, transfer, rid, num_tokens, seed, now):
    """A decode layer's Retrieve of random pages: every slot it returns holds its page."""
    g = torch.Generator().manual_seed(seed)
    layer = int(torch.randint(L, (1,), generator=g))
    num_pages = -(-num_tokens // S)
    row = torch.tensor([kv.row(rid)])
    want = torch.full((1, HKV, MANDATORY), -1, dtype=torch.long)
    num_selected = torch.zeros(1, HKV, dtype=torch.long)
    for h in range(HKV):
        k = int(torch.randint(1, min(MANDATORY, num_pages) + 1, (1,), generator=g))
        want[0, h, :k] = torch.randperm(num_pages, generator=g)[:k].sort().values
        num_selected[0, h] = k
    tail = torch.tensor([(num_tokens - 1) % S + 1])
    # The write-through rewrites the tail slot's newest token: give it the value it holds.
    last = want.gather(-1, (num_selected - 1)[..., None])[0, :, 0]  # [Hkv]
    k = torch.tensor([_value(rid, layer, h, int(last[h])) for h in range(HKV)])[:, None].expand(HKV, D)
    slots, _ = transfer.retrieve(row, layer, want, num_selected, tail, torch.tensor([now]), k.contiguous(),
                                 (-k).contiguous())
    for h in range(HKV):
        for j in range(int(num_selected[0, h])):
            page = int(want[0, h, j])
            assert kv.buffer.k_slots[int(slots[0, h, j]), 0, 0] == _value(rid, layer, h, page)
