"""The CPU's paged decode paths (``paged_decode_cpu``: SDPA over gathered pages, and the
gather planned once a step) against the float64 oracle and the torch reference, and the
engine's choice of them."""

from __future__ import annotations

import pytest
import torch

import spin_cluster.kernels.paged_decode_cpu as pdc
from spin_cluster.kernels.paged_decode import paged_decode_attention_ref
from spin_cluster.kernels.paged_decode_cpu import (
    paged_decode_attention_planned,
    paged_decode_attention_sdpa,
    plan_gathered_decode,
)

from .paged_decode_cases import RAGGED_16, REF_TOL, assert_close, dense_oracle, make_case


# --------------------------------------------------------------------------------------
# The CPU path (SDPA over gathered pages) vs the float64 oracle and the reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_sdpa_path_matches_dense_oracle(dtype, group):
    case = make_case(RAGGED_16, group=group, dtype=dtype, seed=10 + group, device="cpu")
    out = paged_decode_attention_sdpa(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert_close(out, dense_oracle(*case), REF_TOL[dtype])


def test_float32_queries_over_float16_pages_match_the_oracle_on_the_widened_pages():
    # cache.kv_cache_dtype float16 where the native kernel cannot run: both gather paths widen
    q, k, v, bt, lens = make_case(RAGGED_16, group=3, seed=16, device="cpu")
    k, v = k.half(), v.half()
    want = dense_oracle(q, k.float(), v.float(), bt, lens)
    assert_close(paged_decode_attention_sdpa(q, k, v, bt, lens), want, REF_TOL[torch.float32])
    plan = plan_gathered_decode(bt[:, None], lens, k)
    out = paged_decode_attention_planned(q, k, v, plan, 0)
    assert out.dtype == torch.float32
    assert_close(out, want, REF_TOL[torch.float32])


def test_sdpa_path_groups_requests_and_scales(monkeypatch):
    # a one-byte budget: every request is its own group, each padded to its own length only
    monkeypatch.setattr(pdc, "_SDPA_GROUP_BYTES", 1)
    case = make_case([7, 50, 1, 33, 16, 2], page_size=8, group=4, seed=13, device="cpu")
    out = paged_decode_attention_sdpa(*case, scale=0.3)
    assert_close(out, dense_oracle(*case, scale=0.3), REF_TOL[torch.float32])


@pytest.mark.parametrize("group_bytes", [1, 8 * 1024 * 1024])
def test_sdpa_path_empty_rows_and_per_head_lengths(monkeypatch, group_bytes):
    # sparse decode gives each KV head its own length; some rows (and a whole request) are empty
    monkeypatch.setattr(pdc, "_SDPA_GROUP_BYTES", group_bytes)
    q, k, v, bt, _ = make_case([40, 40, 40], num_kv_heads=3, group=2, page_size=8, seed=14, device="cpu")
    lens = torch.tensor([[40, 0, 17], [0, 0, 0], [1, 40, 8]], dtype=torch.int32)
    out = paged_decode_attention_sdpa(q, k, v, bt, lens)
    assert torch.all(out[1] == 0) and torch.all(out[0, 2:4] == 0)
    assert_close(out, paged_decode_attention_ref(q, k, v, bt, lens), REF_TOL[torch.float32])


def test_sdpa_path_writes_out():
    case = make_case([3, 20], seed=15, device="cpu")
    out = torch.full_like(case[0], float("nan"))
    assert paged_decode_attention_sdpa(*case, out=out) is out
    assert_close(out, dense_oracle(*case), REF_TOL[torch.float32])


def planned(q, k_pages, v_pages, block_tables, seq_lens, layers=1, scale=None, out=None):
    """The planned path over ``layers`` copies of one layer's tables; returns layer L-1's output."""
    tables = torch.stack([block_tables] * layers, dim=1)  # [B, L, Hkv, P]
    plan = plan_gathered_decode(tables, seq_lens, k_pages)
    return paged_decode_attention_planned(q, k_pages, v_pages, plan, layers - 1, scale=scale, out=out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_planned_path_matches_dense_oracle(dtype, group):
    case = make_case(RAGGED_16, group=group, dtype=dtype, seed=20 + group, device="cpu")
    out = planned(*case, layers=2)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert_close(out, dense_oracle(*case), REF_TOL[dtype])


@pytest.mark.parametrize("group_bytes", [1, 8 * 1024 * 1024])
def test_planned_path_groups_masks_and_writes_out(monkeypatch, group_bytes):
    # one-byte groups: every request alone and unmasked; one group: masks for the short rows
    monkeypatch.setattr(pdc, "_SDPA_GROUP_BYTES", group_bytes)
    case = make_case([7, 50, 1, 33, 16, 2], page_size=8, group=4, seed=23, device="cpu")
    out = torch.full_like(case[0], float("nan"))
    assert planned(*case, scale=0.3, out=out) is out
    assert_close(out, dense_oracle(*case, scale=0.3), REF_TOL[torch.float32])


def test_planned_path_reads_each_layers_own_pages():
    q, k, v, bt, lens = make_case([9, 40], num_kv_heads=2, group=2, page_size=8, seed=24, device="cpu")
    other = bt.flip(0).clone()  # layer 1: the requests' pages swapped
    other[0, :, 5:] = 0
    lens1 = lens.flip(0)
    tables = torch.stack([bt, other], dim=1)
    plan = plan_gathered_decode(tables, lens, k)
    assert_close(paged_decode_attention_planned(q, k, v, plan, 0), dense_oracle(q, k, v, bt, lens), REF_TOL[torch.float32])
    plan1 = plan_gathered_decode(tables, lens1, k)
    assert_close(paged_decode_attention_planned(q, k, v, plan1, 1), dense_oracle(q, k, v, other, lens1),
                 REF_TOL[torch.float32])


def test_planned_path_rejects_empty_and_overlong_rows():
    q, k, v, bt, _ = make_case([9, 40], page_size=8, seed=25, device="cpu")
    for bad in ([0, 40], [9, 41]):
        with pytest.raises(ValueError, match="seq_lens"):
            plan_gathered_decode(bt[:, None], torch.tensor(bad, dtype=torch.int32), k)


def test_cpu_decode_path_is_the_sdpa_one():
    from spin_cluster.dense_attention import decode_impl

    assert decode_impl("auto", torch.device("cpu")) is paged_decode_attention_sdpa
    assert decode_impl("torch", torch.device("cpu")) is paged_decode_attention_ref
    with pytest.raises(ValueError, match="sdpa"):
        decode_impl("flash", torch.device("cpu"))


@pytest.mark.parametrize("impl,kernel", [("auto", True), ("auto", False), ("torch", True)])
def test_cpu_backend_plans_decode_once_a_step(impl, kernel, monkeypatch):
    # 'auto' on the CPU: the in-place C kernel (kernels/cpu_native.py) where it builds;
    # where it does not, the paged backend builds the gather plan in begin_step and every
    # layer's decode reads it; 'torch' (the oracle) keeps the per-layer reference
    from spin_cluster.engine.paged_attention import PagedAttention
    from spin_cluster.kernels import cpu_native

    if kernel and impl == "auto" and not cpu_native.available():
        pytest.skip("no C compiler: the kernel=False case covers this machine")
    if not kernel:
        monkeypatch.setattr(cpu_native, "available", lambda: False)
    from spin_cluster.engine.request import Request, SamplingParams
    from spin_cluster.engine.scheduler import ScheduledChunk
    from spin_cluster.kvcache.manager import KVCacheManager

    kv = KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=64,
                        max_seqs=2, max_model_len=32, dtype=torch.float32)
    reqs = [Request(f"r{i}", list(range(1, 6 + 4 * i)), SamplingParams()) for i in range(2)]
    for r in reqs:
        kv.allocate(r.request_id, r.num_tokens + 1)
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(7)
    chunks = [ScheduledChunk(r, r.num_computed_tokens, 1, True) for r in reqs]
    positions = torch.tensor([c.start for c in chunks])
    backend = PagedAttention(kv, decode=impl)
    backend.begin_step(chunks, positions, kv.rows([r.request_id for r in reqs]))
    gen = torch.Generator().manual_seed(3)
    kv.pool.k_pages.normal_(generator=gen)
    kv.pool.v_pages.normal_(generator=gen)
    q = torch.randn(2, 4, 8, generator=gen)
    k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    out = backend.forward(1, q, k, v)
    assert (backend.plan.gathered is not None) == (impl == "auto" and not kernel)
    assert backend._in_place == (impl == "auto" and kernel)
    tables = kv.block_tables(kv.rows([r.request_id for r in reqs]), 4)[:, 1]
    expected = dense_oracle(q, kv.pool.k_pages, kv.pool.v_pages, tables, positions.to(torch.int32) + 1)
    assert_close(out, expected, REF_TOL[torch.float32])
