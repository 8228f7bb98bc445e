"""The buffer lookup: Triton kernel (one launch) == the torch reference, on random shares.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 so the kernel runs in Triton's interpreter
on CPU tensors. Every output and every in-place update is compared: slots, misses, the
shares' pages and last uses (for every row and layer, so a write outside the step's rows or
layer shows), and the counters. The policy itself (hits keep columns, the bucketed LRU picks
victims) is tested against the buffer in tests/kvcache/test_buffer.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from spin_cluster.kernels.buffer_lookup import (
    HomeMap,
    buffer_lookup,
    buffer_lookup_ref,
    page_columns,
    resident_pages,
    resident_pages_ref,
    resolve_selected,
    resolve_selected_ref,
)

from .conftest import check_impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEVER = -(2**30)


def make_case(R, L, H, C, K, share, rows, layer, now, seed, num_pages=40):
    """Shares of ``share`` columns (distinct slots), some holding pages, random last uses;
    each head of each row selects up to K distinct pages, some held (hits), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    res_slot = torch.full((R, L, H, C), -1, dtype=torch.int32)
    res_page = torch.full((R, L, H, C), -1, dtype=torch.int32)
    last = torch.full((R, L, H, C), NEVER, dtype=torch.int32)
    perm = torch.randperm(R * L * H * share, generator=g).int().view(R, L, H, share)
    res_slot[..., :share] = perm
    for r in range(R):
        for l in range(L):
            for h in range(H):
                held = torch.randperm(num_pages, generator=g)[:share]
                keep = torch.rand(share, generator=g) < 0.7
                res_page[r, l, h, :share] = torch.where(keep, held, -1).int()
                ages = torch.randint(0, 12, (share,), generator=g)
                old = torch.rand(share, generator=g) < 0.2
                last[r, l, h, :share] = torch.where(old, torch.tensor(NEVER), now - ages).int()
    B = len(rows)
    want = torch.full((B, H, K), -1, dtype=torch.int64)
    for b, r in enumerate(rows):
        for h in range(H):
            n = int(torch.randint(0, K + 1, (1,), generator=g))
            held = [p for p in res_page[r, layer, h].tolist() if p >= 0]
            pool = torch.randperm(num_pages, generator=g).tolist()
            picks = (held[: n // 2] + [p for p in pool if p not in held[: n // 2]])[:n]
            want[b, h, :n] = torch.tensor(sorted(picks), dtype=torch.int64)
    to = dict(device=DEVICE)
    return (res_page.to(**to), res_slot.to(**to), last.to(**to), torch.tensor(rows, dtype=torch.int64, **to),
            layer, want.to(**to), now)


CASES = [
    # R, L, H, C, K, share, rows, layer, now
    (3, 2, 2, 12, 6, 10, [2, 0], 1, 20),  # shares narrower than the columns
    (2, 1, 3, 7, 5, 7, [1], 0, 5),  # C and K not powers of two
    (4, 3, 1, 16, 16, 16, [3, 1, 0], 2, 100),  # share == K: every column may be needed
    (2, 2, 2, 9, 4, 9, [0, 1], 0, 3),
]


def _steps_equal_reference(case, seed, reuse, num_pages, shift, chunk=0):
    """Two steps of the kernel and the reference from the same shares (the second over the
    updated shares, selecting partly other pages): outputs, shares, map and counters equal.
    Returns the kernel's counters."""
    a = list(make_case(*case, seed=seed, num_pages=num_pages))
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    col_a, col_b = page_columns(a[0], num_pages), page_columns(b[0], num_pages)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for num_buckets in (64, 4):  # 4: ages beyond the last bucket collapse, ties go by column
        ra = buffer_lookup(*a, ca, num_buckets=num_buckets, reuse=reuse, res_col=col_a, chunk=chunk, impl="triton")
        rb = buffer_lookup_ref(*b, cb, num_buckets=num_buckets, reuse=reuse, res_col=col_b)
        for x, y, name in zip(ra, rb, ("slots", "miss_dst", "miss")):
            assert torch.equal(x, y), name
        assert torch.equal(a[0], b[0]), "res_page"
        assert torch.equal(a[2], b[2]), "last_use"
        assert torch.equal(ca, cb), "counters"
        if reuse:  # the kernel kept the map in step with the shares it changed
            assert torch.equal(col_a, col_b) and torch.equal(col_a, page_columns(a[0], num_pages)), "res_col"
        for x in (a, b):
            x[6] += 3
            x[5] = torch.where(x[5] >= 0, (x[5] + shift) % num_pages, -1)
    return ca


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference(case, reuse):
    counters = _steps_equal_reference(case, sum(case[:6]) + int(reuse), reuse, num_pages=40, shift=5)
    assert counters[0] > 0 and counters[2] > 0  # the cases do look up and miss


CHUNKED_CASES = [
    # R, L, H, C, K, share, rows, layer, now: several 16-wide chunks of columns and selections
    (3, 2, 2, 40, 37, 40, [2, 0], 1, 20),
    (2, 1, 3, 50, 20, 33, [1], 0, 5),  # a share narrower than the columns, over 3 chunks
    (4, 2, 1, 16, 16, 16, [3, 1, 0], 1, 100),  # exactly one chunk
]


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("case", CHUNKED_CASES)
def test_kernel_in_several_chunks_equals_reference(case, reuse):
    counters = _steps_equal_reference(case, sum(case[:6]) + 3 * int(reuse), reuse, num_pages=90, shift=11, chunk=16)
    assert counters[2] > 0 and (counters[3] > 0 or not reuse)  # misses, and evictions of held pages


def test_an_uncounted_rows_lookups_update_its_share_but_not_the_counters():
    """``uncounted_row`` (the padding row's): its lookups resolve and update its share as
    any row's, and the counters hold the other rows' alone, in the kernel and the reference."""
    case = (3, 2, 2, 12, 6, 10, [2, 0], 1, 20)  # rows 2 and 0

    def lookup(impl, keep=slice(None), **kw):
        page, slot, last, rows, layer, want, now = make_case(*case, seed=4)
        counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        out = buffer_lookup(page, slot, last, rows[keep], layer, want[keep], now, counters,
                            res_col=page_columns(page, 40), impl=impl, **kw)
        return out, (page, last), counters

    for impl in ("triton", "torch"):
        out, shares, counters = lookup(impl, uncounted_row=2)
        all_out, all_shares, all_counters = lookup(impl)
        assert all(torch.equal(x, y) for x, y in zip(out + shares, all_out + all_shares)), impl
        _, _, row0 = lookup(impl, keep=slice(1, 2))
        assert torch.equal(counters, row0) and counters[0] > 0, impl  # row 2's lookups left out
        assert all_counters[0] > counters[0], impl


def test_the_kernel_needs_the_page_map():
    a = list(make_case(2, 1, 1, 20, 18, 20, [1], 0, 9, seed=5))
    counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="res_col"):
        buffer_lookup(*a, counters, impl="triton")
    with pytest.raises(ValueError, match="res_col must be"):
        buffer_lookup(*a, counters, res_col=page_columns(a[0], 40).int(), impl="triton")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_step_index_from_a_device_tensor_equals_the_int(impl):
    fn = functools.partial(buffer_lookup, impl=impl)
    # A CUDA graph replays the lookup with the step index it reads from the device.
    a = list(make_case(3, 2, 2, 12, 6, 10, [2, 0], 1, 20, seed=3))
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    b[6] = torch.tensor([a[6]], dtype=torch.int32, device=DEVICE)
    col_a, col_b = page_columns(a[0], 40), page_columns(b[0], 40)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        ra, rb = fn(*a, ca, num_buckets=4, res_col=col_a), fn(*b, cb, num_buckets=4, res_col=col_b)
        for x, y, name in zip(ra, rb, ("slots", "miss_dst", "miss")):
            assert torch.equal(x, y), name
        assert torch.equal(a[2], b[2]) and torch.equal(a[0], b[0])
        a[6] += 2
        b[6] += 2  # in place, as the engine advances its step tensor
        a[5] = b[5] = torch.where(a[5] >= 0, (a[5] + 7) % 40, -1)
    assert int(a[2].max()) == 24  # the last lookup stamped its columns with the tensor's value
    with pytest.raises(ValueError, match="now"):
        fn(*a[:6], torch.tensor([1, 2], device=DEVICE), ca, res_col=col_a)


def test_every_miss_gets_its_own_victim_and_hits_keep_their_slot():
    res_page, res_slot, last, rows, layer, want, now = make_case(2, 1, 2, 10, 6, 10, [0, 1], 0, 9, seed=7)
    before_page, before_slot = res_page.clone(), res_slot.clone()
    counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    slots, miss_dst, miss = buffer_lookup(res_page, res_slot, last, rows, layer, want, now, counters,
                                          res_col=page_columns(res_page, 40), impl="triton")
    for b, r in enumerate(rows.tolist()):
        for h in range(want.shape[1]):
            held = dict(zip(before_page[r, 0, h].tolist(), before_slot[r, 0, h].tolist()))
            taken = set()
            for k, p in enumerate(want[b, h].tolist()):
                if p < 0:
                    continue
                s = int(slots[b, h, k])
                if p in held and held[p] >= 0 and p >= 0:
                    assert not miss[b, h, k] and s == held[p]
                else:
                    assert miss[b, h, k] and s not in taken and int(miss_dst.view_as(slots)[b, h, k]) == s
                    taken.add(s)


def test_bad_shapes_are_refused():
    res_page, res_slot, last, rows, layer, want, now = make_case(2, 1, 2, 10, 6, 10, [0], 0, 9, seed=1)
    counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"want must be \[B, Hkv, K\]"):
        buffer_lookup_ref(res_page, res_slot, last, rows, layer, want[:, :1], now, counters)
    with pytest.raises(ValueError, match="counters"):
        buffer_lookup_ref(res_page, res_slot, last, rows, layer, want, now, counters.int())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_equals_reference_at_llama_shapes():
    """16 requests x 8 KV heads, 70 selected pages of a 140-column share (Llama-3.1-8B with a
    2K budget in pages of 32), three steps in a row."""
    a = list(make_case(16, 2, 8, 140, 70, 140, list(range(15, -1, -1)), 1, 50, seed=3, num_pages=400))
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    col = page_columns(a[0], 400)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        ra, rb = buffer_lookup(*a, ca, res_col=col, impl="triton"), buffer_lookup_ref(*b, cb)
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(ca, cb)
        for x in (a, b):
            x[6] += 1
            x[5] = torch.where(x[5] >= 0, (x[5] + 7) % 400, -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_equals_reference_at_shplb_widths():
    """4 requests x 8 KV heads, 540 selected pages of a 1080-column share (the widest S-HPLB
    head at a 2K mean budget, pages of 32), three steps in a row."""
    a = list(make_case(4, 2, 8, 1080, 540, 1080, [3, 0, 2, 1], 1, 50, seed=4, num_pages=4096))
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    col = page_columns(a[0], 4096)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        ra, rb = buffer_lookup(*a, ca, res_col=col, impl="triton"), buffer_lookup_ref(*b, cb)
        assert torch.equal(col, page_columns(a[0], 4096))
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(ca, cb)
        for x in (a, b):
            x[6] += 1
            x[5] = torch.where(x[5] >= 0, (x[5] + 7) % 4096, -1)


@pytest.mark.parametrize("reuse", [True, False])
def test_kernel_equals_reference_on_per_head_widths(reuse):
    """Shares whose heads have their own widths (BufferPolicy.per_head_shares): columns past a head's
    width hold no slot, and no head selects more pages than its width. Every output and
    update equals the reference's, and nothing lands past a head's width."""
    num_pages, widths = 60, (20, 3, 9)  # heads of 20, 3 and 9 columns of C = 20
    a = list(make_case(3, 2, 3, 20, 12, 20, [2, 0], 1, 30, seed=7, num_pages=num_pages))
    for h, w in enumerate(widths):
        a[1][:, :, h, w:] = -1  # res_slot
        a[0][:, :, h, w:] = -1  # res_page
        a[2][:, :, h, w:] = NEVER  # last_use
        a[5][:, h, w:] = -1  # want: at most w pages (a sorted prefix stays sorted)
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    col_a, col_b = page_columns(a[0], num_pages), page_columns(b[0], num_pages)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for _ in range(3):
        ra = buffer_lookup(*a, ca, reuse=reuse, res_col=col_a, impl="triton")
        rb = buffer_lookup_ref(*b, cb, reuse=reuse, res_col=col_b)
        for x, y, name in zip(ra, rb, ("slots", "miss_dst", "miss")):
            assert torch.equal(x, y), name
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(ca, cb)
        for h, w in enumerate(widths):
            assert (a[0][:, :, h, w:] == -1).all() and (a[2][:, :, h, w:] == NEVER).all()
        for x in (a, b):
            x[6] += 2
            x[5] = torch.where(x[5] >= 0, (x[5] + 13) % num_pages, -1)
    assert ca[2] > 0  # misses happened


def test_impl_choice():
    def make():
        a = make_case(2, 1, 2, 7, 5, 7, [1, 0], 0, 5, seed=11)
        counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        return [*a, counters], dict(num_buckets=4, res_col=page_columns(a[0], 40))
    check_impls(buffer_lookup, buffer_lookup_ref, make)


def _resolve_case(case, seed, num_pages, E, gpu_homes):
    """make_case's shares and selections, plus a directory whose segments are host or GPU
    homes (about half each with ``gpu_homes``), each head's count of selected pages and each
    row's tail length."""
    args = list(make_case(*case, seed=seed, num_pages=num_pages))
    R, L, H = case[:3]
    g = torch.Generator().manual_seed(seed + 1)
    n_seg = -(-num_pages // E)
    ids = torch.randperm(2 * R * L * H * n_seg, generator=g)[: R * L * H * n_seg].int().view(R, L, H, n_seg)
    first_gpu = R * L * H * n_seg if gpu_homes else 2 * R * L * H * n_seg
    stamps = torch.full((2 * R * L * H * n_seg - first_gpu + 1,), -5, dtype=torch.int32)
    homes = HomeMap(directory=ids.to(DEVICE), segment_pages=E, page_size=8, first_gpu_segment=first_gpu,
                    gpu_slot_offset=1000, gpu_last_use=stamps.to(DEVICE) if gpu_homes else None)
    want = args[5]
    num_selected = (want >= 0).sum(-1)
    tail_len = torch.randint(1, 9, (want.shape[0],), generator=g).int().to(DEVICE)
    return args, homes, num_selected, tail_len


def _resolve_steps_equal_reference(case, num_pages, gpu_homes, chunk=0):
    """The one-launch resolution (GPU homes read in place, the lookup, the epilogue) against
    its torch composition, over two steps: every output, the shares, the map, the GPU homes'
    stamps and the counters. Returns the first step's outputs, selections and directory view."""
    a, homes_a, num_sel, tail = _resolve_case(case, sum(case[:6]), num_pages, 4, gpu_homes)
    b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
    homes_b = dataclasses.replace(homes_a, gpu_last_use=None if homes_a.gpu_last_use is None
                                  else homes_a.gpu_last_use.clone())
    col_a, col_b = page_columns(a[0], num_pages), page_columns(b[0], num_pages)
    ca, cb = torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for step in range(2):
        ra = resolve_selected(*a[:6], num_sel, tail, a[6], ca, homes_a, num_buckets=4, res_col=col_a, chunk=chunk,
                              impl="triton")
        rb = resolve_selected_ref(*b[:6], num_sel, tail, b[6], cb, homes_b, num_buckets=4, res_col=col_b)
        for x, y, name in zip(ra, rb, ("slots", "miss_dst", "src", "lens", "tail_slot")):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]), "shares"
        assert torch.equal(col_a, col_b), "res_col"
        assert torch.equal(ca, cb), "counters"
        if gpu_homes:
            assert torch.equal(homes_a.gpu_last_use[:-1], homes_b.gpu_last_use[:-1]), "GPU homes' stamps"
        if step == 0:
            first, want = ra, a[5]
        for x in (a, b):
            x[6] += 3
            x[5] = torch.where(x[5] >= 0, (x[5] + 5) % num_pages, -1)  # partly other pages
    seg = homes_a.directory[a[3], a[4]].gather(2, want.clamp(min=0).long() // 4)
    return first, want, (want >= 0) & (seg >= homes_a.first_gpu_segment)


@pytest.mark.parametrize("gpu_homes", [True, False])
@pytest.mark.parametrize("case", CASES[:2] + CHUNKED_CASES[:2])
def test_resolve_kernel_equals_reference(case, gpu_homes):
    num_pages = 90 if case in CHUNKED_CASES else 40
    (slots, miss_dst, src, _, _), want, home = _resolve_steps_equal_reference(
        case, num_pages, gpu_homes, chunk=16 if case in CHUNKED_CASES else 0)
    assert bool(home.any()) == gpu_homes  # the cases do have pages at home on the GPU
    assert bool((slots[home] >= 1000).all()) and not bool((miss_dst.view_as(want)[home] >= 0).any())
    assert int((src >= 0).sum()) == int((miss_dst >= 0).sum()) > 0  # every miss has its host page


def test_resolve_lengths_and_tail_slots_by_hand():
    """Each head attends (num_selected - 1) * S + tail_len tokens and writes its newest token
    at its last selected page's slot * S + tail_len - 1 (S = 8 in ``_resolve_case``)."""
    a, homes, num_sel, tail = _resolve_case(CASES[0], 2, 40, 4, True)
    counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    slots, _, _, lens, tail_slot = resolve_selected(*a[:6], num_sel, tail, a[6], counters, homes, impl="triton",
                                                    res_col=page_columns(a[0], 40))
    for b in range(num_sel.shape[0]):
        for h in range(num_sel.shape[1]):
            n, t = int(num_sel[b, h]), int(tail[b])
            assert int(lens[b, h]) == (n - 1) * 8 + t
            if n:
                assert int(tail_slot[b * num_sel.shape[1] + h]) == int(slots[b, h, n - 1]) * 8 + t - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case,num_pages", [
    ((16, 2, 8, 140, 70, 140, list(range(15, -1, -1)), 1, 50), 400),  # Llama-3.1-8B, a 2K budget
    ((4, 2, 8, 1080, 540, 1080, [3, 0, 2, 1], 1, 50), 4096),  # the widest S-HPLB head
])
def test_resolve_kernel_equals_reference_at_real_shapes(case, num_pages):
    _, _, home = _resolve_steps_equal_reference(case, num_pages, gpu_homes=True)
    assert bool(home.any()) and not bool(home.all())


def test_resolve_refuses_mismatched_shapes():
    a, homes, num_sel, tail = _resolve_case(CASES[0], 1, 40, 4, True)
    counters = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="num_selected"):
        resolve_selected_ref(*a[:6], num_sel[:, :1], tail, a[6], counters, homes)
    with pytest.raises(ValueError, match="directory"):
        resolve_selected_ref(*a[:6], num_sel, tail, a[6], counters,
                             dataclasses.replace(homes, directory=homes.directory.long()))


@pytest.mark.parametrize("gpu_homes", [True, False, None])
@pytest.mark.parametrize("num_pages", [40, 23])
def test_resident_pages_kernel_equals_reference(gpu_homes, num_pages):
    """Pages a step reads without a transfer: held by the share (the map) or at home on the
    GPU. ``gpu_homes`` None: no home map at all."""
    a, homes, _, _ = _resolve_case(CASES[0], 4, 40, 4, bool(gpu_homes))
    col = page_columns(a[0], 40)
    homes = None if gpu_homes is None else homes
    got = resident_pages(col, a[3], a[4], num_pages, homes, impl="triton")
    ref = resident_pages_ref(col, a[3], a[4], num_pages, homes)
    assert got.dtype == torch.bool and got.shape == ref.shape and torch.equal(got, ref)
    held = col[a[3], a[4], :, :num_pages] >= 0
    assert bool((got & ~held).any()) == bool(gpu_homes)  # GPU homes add pages the share does not hold
