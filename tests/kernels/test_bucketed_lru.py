"""Bucketed LRU: the stand-alone Triton kernel (``profiling/lru_kernel.py``) vs the pure-torch
reference (the rule itself is tested, with named victims, in tests/profiling/test_lru.py).

Without CUDA the kernel runs in Triton's interpreter; the block sizes are shrunk so that
tiny rows still span several blocks and several steps of the cutoff program's loop.
"""

from __future__ import annotations

import pytest
import torch

import spin_cluster.profiling.lru_kernel as lru_mech
from spin_cluster.kernels.bucketed_lru import bucketed_lru_victims_ref
from spin_cluster.profiling.lru_kernel import bucketed_lru_victims

from .conftest import check_impls

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

pytestmark = pytest.mark.skipif(not lru_mech.triton_available(), reason="triton not importable")


@pytest.fixture
def small_blocks(monkeypatch):
    """16 slots per block, 2 blocks per step of the cutoff loop."""
    monkeypatch.setattr(lru_mech, "_BLOCK", 16)
    monkeypatch.setattr(lru_mech, "_BLOCKS_PER_ITER", 2)


def random_slots(B, N, max_age, seed, protected=0.2):
    gen = torch.Generator().manual_seed(seed)
    now = 1000
    last_use = (now - torch.randint(0, max_age, (B, N), generator=gen)).to(torch.int32)
    evictable = torch.rand(B, N, generator=gen) >= protected
    return last_use.to(DEVICE), evictable.to(DEVICE), now


def assert_same(args):
    got_mask, got_n = bucketed_lru_victims(*args, impl="triton")
    exp_mask, exp_n = bucketed_lru_victims_ref(*args)
    assert got_mask.dtype == torch.bool and got_n.dtype == torch.int64
    assert torch.equal(got_mask, exp_mask)
    assert torch.equal(got_n, exp_n)


@pytest.mark.parametrize("N", [1, 15, 16, 50, 77])
@pytest.mark.parametrize("num_buckets,bucket_width", [(64, 1), (4, 2), (1, 1), (7, 3)])
def test_matches_reference_across_blocks(small_blocks, N, num_buckets, bucket_width):
    last_use, evictable, now = random_slots(3, N, 40, seed=N)
    needs = [0, 1, N // 3, N, N + 4, -2]
    for need in needs:
        assert_same((last_use, evictable, now, need, num_buckets, bucket_width))
    per_row = torch.tensor([N // 2, 1, N], device=DEVICE)
    assert_same((last_use, evictable, now, per_row, num_buckets, bucket_width))


def test_device_scalars_and_per_row_now(small_blocks):
    last_use, evictable, _ = random_slots(2, 40, 30, seed=1)
    now = torch.tensor([1000, 990], device=DEVICE)
    need = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    assert_same((last_use, evictable, now, need, 8, 2))
    assert_same((last_use.long(), evictable, torch.tensor(995, device=DEVICE), 1, 8, 1))


def test_full_block_size_one_block_of_many_ties():
    last_use, evictable, now = random_slots(1, 3000, 200, seed=2)  # most ages past 63
    for need in (0, 5, 1500, 3000):
        assert_same((last_use, evictable, now, need, 64, 1))


def test_column_stride_checked():
    last_use, evictable, now = random_slots(2, 8, 10, seed=3)
    with pytest.raises(ValueError, match="contiguous"):
        bucketed_lru_victims(last_use.t(), evictable.t(), now, 1, impl="triton")


@pytest.mark.gpu
def test_million_slots_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    N = 1 << 20
    last_use = (10_000 - torch.randint(0, 128, (N,), device="cuda", generator=gen)).int()
    evictable = torch.rand(N, device="cuda", generator=gen) >= 0.1
    args = (last_use[None], evictable[None], torch.tensor(10_000, device="cuda"), N // 10)
    assert_same(args + (64, 1))
    assert_same(args + (64, 2))


def test_impl_choice(small_blocks):
    last_use, evictable, now = random_slots(2, 37, 30, seed=5)
    check_impls(bucketed_lru_victims, bucketed_lru_victims_ref, lambda: ([last_use, evictable, now, 9, 8, 2], {}))
