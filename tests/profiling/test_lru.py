"""Bucketed LRU eviction: hand-written pools with named victims, and properties against
exact LRU and against a plain-Python reading of the documented rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spin_cluster.profiling.lru import (
    select_victims,
    select_victims_batched,
    select_victims_exact,
    select_victims_exact_batched,
    slot_buckets,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
IMPLS = ["torch", "triton"]  # triton runs in the interpreter without CUDA


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def victim_ids(mask):
    return mask.nonzero().flatten().tolist()


def bucketed(last_use, evictable, now, need, impl="torch", **kw):
    mask, n = select_victims(t(last_use), t(evictable, torch.bool), now, need, impl=impl, **kw)
    return victim_ids(mask), int(n)


def rule_oracle(last_use, evictable, now, need, num_buckets, bucket_width):
    """The module docstring's rule, read literally: sort by (bucket desc, slot id)."""
    def bucket(i):
        return min(max(now - last_use[i], 0) // bucket_width, num_buckets - 1)

    candidates = [i for i in range(len(last_use)) if evictable[i]]
    order = sorted(candidates, key=lambda i: (-bucket(i), i))
    return sorted(order[: max(0, need)])


# --------------------------------------------------------------------------------------
# Hand-written pools
# --------------------------------------------------------------------------------------

#            slot:  0  1  2  3   4  5  6  7
LAST_USE = [9, 5, 7, 5, 10, 3, 7, 5]  # now=10 -> ages 1 5 3 5 0 7 3 5
ALL = [True] * 8


def test_cutoff_inside_a_bucket_takes_lowest_ids(impl):
    # Oldest: slot 5 (age 7); then age 5 holds slots 1, 3, 7 and two of them are needed.
    assert bucketed(LAST_USE, ALL, 10, 3, impl=impl) == ([1, 3, 5], 3)


def test_wider_buckets_merge_ages(impl):
    # bucket_width=2, 4 buckets: ages 1 5 3 5 0 7 3 5 -> buckets 0 2 1 2 0 3 1 2.
    wide = dict(impl=impl, num_buckets=4, bucket_width=2)
    assert bucketed(LAST_USE, ALL, 10, 4, **wide) == ([1, 3, 5, 7], 4)
    # One more comes from bucket 1 = {2, 6}: the lower id.
    assert bucketed(LAST_USE, ALL, 10, 5, **wide) == ([1, 2, 3, 5, 7], 5)
    buckets = slot_buckets(t(LAST_USE), 10, num_buckets=4, bucket_width=2)
    assert buckets.tolist() == [0, 2, 1, 2, 0, 3, 1, 2]


def test_all_tied_takes_lowest_ids(impl):
    assert bucketed([4] * 6, [True] * 6, 9, 2, impl=impl) == ([0, 1], 2)


def test_non_evictable_slots_skipped(impl):
    evictable = [True, False, True, False, True, False, True, True]
    # Slot 5 (oldest) and slots 1, 3 (age 5) are protected: 7 (age 5), then 2 (age 3).
    assert bucketed(LAST_USE, evictable, 10, 2, impl=impl) == ([2, 7], 2)


def test_needing_more_than_evictable_takes_all_evictable(impl):
    evictable = [False, True, False, False, True, False, False, True]
    assert bucketed(LAST_USE, evictable, 10, 5, impl=impl) == ([1, 4, 7], 3)
    assert bucketed(LAST_USE, [False] * 8, 10, 5, impl=impl) == ([], 0)


def test_needing_zero_or_negative_takes_none(impl):
    assert bucketed(LAST_USE, ALL, 10, 0, impl=impl) == ([], 0)
    assert bucketed(LAST_USE, ALL, 10, -3, impl=impl) == ([], 0)


def test_ages_past_the_last_bucket_collapse_into_it(impl):
    # 4 buckets of 1 step: ages 4 50 100 3 1 10 -> buckets 3 3 3 3 1 3. Exact LRU would take
    # slots 2 (age 100) and 1 (age 50); bucketed sees one oldest bucket and takes ids 0, 1.
    last_use = [96, 50, 0, 97, 99, 90]
    assert bucketed(last_use, [True] * 6, 100, 2, impl=impl, num_buckets=4) == ([0, 1], 2)
    exact, n = select_victims_exact(t(last_use), t([True] * 6, torch.bool), 100, 2)
    assert (victim_ids(exact), int(n)) == ([1, 2], 2)


def test_future_last_use_counts_as_age_zero(impl):
    # Slot 1 was used "after" now (e.g. now lags by one step): it is the youngest.
    assert bucketed([3, 12, 0], [True] * 3, 10, 2, impl=impl) == ([0, 2], 2)


def test_device_scalars_and_int32_timestamps(impl):
    mask, n = select_victims(
        t(LAST_USE, torch.int32), t(ALL, torch.bool), t(10), t([3], torch.int32), impl=impl
    )
    assert victim_ids(mask) == [1, 3, 5]
    assert n.dim() == 0 and int(n) == 3


def test_batched_rows_evict_independently(impl):
    last_use = t([[9, 5, 7, 5], [0, 1, 2, 3]])
    evictable = t([[True, True, True, True], [True, True, False, True]], torch.bool)
    need = t([1, 5])
    mask, n = select_victims_batched(last_use, evictable, t([10, 4]), need, impl=impl)
    assert mask.tolist() == [[False, True, False, False], [True, True, False, True]]
    assert n.tolist() == [1, 3]
    # now=4, 2 buckets of 2 steps: row 0 lies in the future (all age 0, bucket 0); row 1 has
    # ages 4 3 2 1 -> buckets 1 1 1 0. One victim each: the lowest id of the oldest bucket.
    mask, n = select_victims_batched(last_use, evictable, 4, t([1, 1]), 2, 2, impl=impl)
    assert mask.tolist() == [[True, False, False, False], [True, False, False, False]]


@pytest.mark.parametrize("method", ["sort", "topk"])
def test_exact_lru_orders_by_age_then_id(method):
    mask, n = select_victims_exact(t(LAST_USE), t(ALL, torch.bool), 10, 3, method=method)
    assert (victim_ids(mask), int(n)) == ([1, 3, 5], 3)
    mask, n = select_victims_exact(t(LAST_USE), t(ALL, torch.bool), 10, 5, method=method)
    assert victim_ids(mask) == [1, 2, 3, 5, 7]  # age 3 ties (2, 6): the lower id
    mask, n = select_victims_exact_batched(
        t([[9, 5, 7, 5], [0, 1, 2, 3]]), t([[True] * 4, [False] * 4], torch.bool),
        10, t([2, 2]), method=method,
    )
    assert mask.tolist() == [[False, True, False, True], [False] * 4] and n.tolist() == [2, 0]


def test_bad_inputs_raise():
    lu, ev = t(LAST_USE), t(ALL, torch.bool)
    with pytest.raises(ValueError, match="bool"):
        select_victims(lu, lu, 10, 1)
    with pytest.raises(ValueError, match="int32 or int64"):
        select_victims(lu.float(), ev, 10, 1)
    with pytest.raises(ValueError, match="shape"):
        select_victims(lu, ev[:3], 10, 1)
    with pytest.raises(ValueError, match=r"\[N\]"):
        select_victims(lu[None], ev[None], 10, 1)
    with pytest.raises(ValueError, match="num_buckets"):
        select_victims(lu, ev, 10, 1, num_buckets=0)
    with pytest.raises(ValueError, match="bucket_width"):
        select_victims(lu, ev, 10, 1, bucket_width=0)
    with pytest.raises(ValueError, match="num_needed"):
        select_victims_batched(lu[None], ev[None], 10, t([1, 2]))
    with pytest.raises(ValueError, match="method"):
        select_victims_exact(lu, ev, 10, 1, method="heap")
    with pytest.raises(ValueError, match="impl"):
        select_victims(lu, ev, 10, 1, impl="numpy")


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------


@st.composite
def pools(draw):
    n = draw(st.integers(1, 40))
    now = draw(st.integers(0, 200))
    last_use = draw(st.lists(st.integers(0, 220), min_size=n, max_size=n))
    evictable = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    need = draw(st.integers(-1, n + 2))
    return last_use, evictable, now, need


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=100, deadline=None)
@given(pools(), st.sampled_from([1, 2, 3, 8, 64]), st.integers(1, 4))
def test_bucketed_follows_the_documented_rule(impl, pool, num_buckets, bucket_width):
    last_use, evictable, now, need = pool
    got, n = bucketed(last_use, evictable, now, need, impl=impl,
                      num_buckets=num_buckets, bucket_width=bucket_width)
    expected = rule_oracle(last_use, evictable, now, need, num_buckets, bucket_width)
    assert got == expected
    assert n == min(max(need, 0), sum(evictable))
    # Every victim is at least as old (bucket-wise) as every evictable slot left behind.
    buckets = slot_buckets(t(last_use), now, num_buckets, bucket_width).tolist()
    kept = [buckets[i] for i in range(len(last_use)) if evictable[i] and i not in got]
    if got and kept:
        assert min(buckets[i] for i in got) >= max(kept)


@settings(max_examples=150, deadline=None)
@given(pools(), st.sampled_from([16, 64, 256]), st.sampled_from(["sort", "topk"]))
def test_bucketed_is_exact_when_every_age_has_its_own_bucket(pool, num_buckets, method):
    last_use, evictable, now, need = pool
    got, n = bucketed(last_use, evictable, now, need, num_buckets=num_buckets)
    mask, n_exact = select_victims_exact(
        t(last_use), t(evictable, torch.bool), now, need, method=method
    )
    assert n == int(n_exact) == min(max(need, 0), sum(evictable))
    ages = [max(now - lu, 0) for lu, ev in zip(last_use, evictable) if ev]
    if all(a < num_buckets for a in ages):  # bucket_width 1: bucket == age
        assert got == victim_ids(mask)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=50, deadline=None)
@given(st.lists(pools(), min_size=1, max_size=4))
def test_batched_equals_one_pool_per_row(impl, rows):
    width = max(len(r[0]) for r in rows)
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    last_use = t([pad(r[0], 0) for r in rows])
    evictable = t([pad(r[1], False) for r in rows], torch.bool)
    now = t([r[2] for r in rows])
    need = t([r[3] for r in rows])
    mask, n = select_victims_batched(last_use, evictable, now, need, 8, impl=impl)
    for i, (lu, ev, nw, nd) in enumerate(rows):
        one, one_n = bucketed(lu, ev, nw, nd, num_buckets=8)
        assert victim_ids(mask[i]) == one and int(n[i]) == one_n


# --------------------------------------------------------------------------------------
# GPU: no host sync, CUDA-graph capture
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_no_host_sync_and_graph_capture(impl):
    gen = torch.Generator().manual_seed(0)
    N = 1 << 16
    last_use = torch.randint(0, 1000, (N,), generator=gen, dtype=torch.int32).cuda()
    evictable = (torch.rand(N, generator=gen) < 0.9).cuda()
    now = torch.tensor(1000, device="cuda")
    need = torch.tensor([N // 10], device="cuda")
    expected, n_expected = select_victims(last_use, evictable, now, need, impl=impl)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_victims(last_use, evictable, now, need, impl=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            mask, n = select_victims(last_use, evictable, now, need, impl=impl)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(mask, expected) and int(n) == int(n_expected) == N // 10
