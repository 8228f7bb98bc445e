"""Prepacked oneDNN GEMMs on the CPU (``spin_cluster.models.cpu_linear``): the same numbers as
``F.linear``, never a stale pack, and the whole model's logits unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spin_cluster.models import cpu_linear, load_model

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("m", [1, 4, 17, 300])
def test_a_pack_computes_f_linear(m):
    g = torch.Generator().manual_seed(m)
    lin = nn.Linear(96, 160)
    x = torch.randn(m, 96, generator=g)
    assert cpu_linear.pack(lin)
    torch.testing.assert_close(cpu_linear.linear(lin, x), nn.functional.linear(x, lin.weight, lin.bias),
                               rtol=1e-5, atol=1e-5)


def test_one_or_two_rows_take_the_plain_weight_until_a_plan_says_otherwise(monkeypatch):
    # DEFAULT_SMALL_ROWS: 1-2 rows the plain weight (the native kernel where built, else
    # bitwise F.linear); the pack (oneDNN) above it
    calls, native = [], []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    real_rows = cpu_linear.cpu_native.linear_rows
    monkeypatch.setattr(cpu_linear.cpu_native, "linear_rows", lambda x, *a: native.append(x.shape[0]) or real_rows(x, *a))
    lin = nn.Linear(96, 160)
    assert cpu_linear.pack(lin)
    for m in (1, 2, 3):
        x = torch.randn(m, 96)
        y = cpu_linear.linear(lin, x)
        want = nn.functional.linear(x, lin.weight, lin.bias)
        if m <= 2 and not cpu_linear._native_rows():
            assert torch.equal(y, want)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert calls == [3]
    assert native == ([1, 2] if cpu_linear._native_rows() else [])
    calls.clear()
    lin.cpu_pack.small_rows = {1: "pad", 2: "pack"}  # a plan: 1 row padded to four, 2 on the pack
    for m in (1, 2):
        torch.testing.assert_close(cpu_linear.linear(lin, torch.randn(m, 96)).shape, torch.Size([m, 160]))
    assert calls == [cpu_linear.PAD_ROWS, 2]


@pytest.mark.parametrize("way", cpu_linear.SMALL_WAYS)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_every_small_row_way_computes_f_linear(way, m):
    g = torch.Generator().manual_seed(10 * m)
    lin = nn.Linear(72, 40)
    assert cpu_linear.pack(lin)
    x = torch.randn(m + 2, 72, generator=g)[1 : m + 1]  # rows of a larger tensor, as the layers pass them
    y = lin.cpu_pack.compute(x, way)
    assert y.shape == (m, 40)
    torch.testing.assert_close(y, nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_padding_reuses_one_buffer_whatever_an_earlier_call_left_in_it():
    lin = nn.Linear(48, 24)
    assert cpu_linear.pack(lin)
    for m in (3, 1, 2, 1):  # fewer rows after more: the buffer's last rows hold older ones
        x = torch.randn(m, 48)
        torch.testing.assert_close(lin.cpu_pack.compute(x, "pad"), nn.functional.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-5)
    assert lin.cpu_pack._pad.shape == (cpu_linear.PAD_ROWS, 48)


def test_the_plan_gives_every_pack_the_fastest_way(monkeypatch, tiny_llama_path):
    model = load_model(tiny_llama_path, progress=False).fuse_projections()
    model.pack_for_cpu()
    packs = cpu_linear.packs_of(model)
    assert len(packs) == 1 + 4 * model.config.num_layers
    # pretend costs: at 1 row padding wins, at 2 the pack, at 3 the plain weight
    cost = {1: {"plain": 3, "pack": 2, "pad": 1}, 2: {"plain": 3, "pack": 1, "pad": 2},
            3: {"plain": 1, "pack": 2, "pad": 3}}
    clock = [0.0]
    monkeypatch.setattr(cpu_linear.time, "perf_counter", lambda: clock[0])

    def compute(self, x, way):
        clock[0] += cost[x.shape[0]][way]
        return x

    monkeypatch.setattr(cpu_linear.PackedLinear, "compute", compute)
    plan = cpu_linear.plan_small_rows(packs)
    assert plan == {1: "pad", 2: "pack", 3: "plain"}
    assert all(p.small_rows == plan for p in packs)


def test_a_replaced_or_changed_weight_is_never_served_from_a_stale_pack():
    lin = nn.Linear(32, 48, bias=False)
    x = torch.randn(3, 32)
    assert cpu_linear.pack(lin)
    lin.weight = nn.Parameter(torch.randn(48, 32))  # replaced (as sharding does)
    torch.testing.assert_close(cpu_linear.linear(lin, x), x @ lin.weight.T)
    assert cpu_linear.pack(lin)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # changed in place
    torch.testing.assert_close(cpu_linear.linear(lin, x), x @ lin.weight.T)


def test_other_dtypes_and_devices_are_not_packed():
    lin = nn.Linear(8, 8).to(torch.bfloat16)
    assert not cpu_linear.pack(lin) and getattr(lin, "cpu_pack", None) is None
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_linear.linear(lin, x), lin(x))


def test_a_packed_model_gives_the_same_logits(tiny_llama_path):
    ref = load_model(tiny_llama_path, progress=False).fuse_projections()
    model = load_model(tiny_llama_path, progress=False).fuse_projections()
    layers = model.config.num_layers
    assert model.pack_for_cpu() == 1 + 4 * layers  # lm_head; per layer q/k/v, o, gate/up, down
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), ref.compute_logits(hidden), rtol=1e-4, atol=1e-4)
    mlp = model.layers[0].mlp
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(mlp(x), ref.layers[0].mlp(x), rtol=1e-4, atol=1e-4)


def test_the_engine_packs_unless_told_not_to(tiny_llama_path):
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams

    outs = {}
    for packed in (False, True):
        cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 128},
               "cache": {"kv_cache_gib": 0.01}}
        engine = Engine(SpinConfig.from_dict(cfg), progress=False, pack_cpu_gemms=packed)
        assert (getattr(engine.model.lm_head, "cpu_pack", None) is not None) is packed
        outs[packed] = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(outs[True][0].token_ids) == len(outs[False][0].token_ids) == 6


@pytest.mark.parametrize("rows", [512, 600, 1000])
@pytest.mark.parametrize("inference", [False, True])
def test_row_blocks_compute_f_linear_and_leave_small_gemms_whole(rows, inference, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    pack = cpu_linear.PackedLinear(w, b)
    x = torch.randn(rows, 24, generator=g)
    calls = []
    real = cpu_linear.PackedLinear.compute
    monkeypatch.setattr(cpu_linear.PackedLinear, "compute", lambda self, xx, way: calls.append(len(xx)) or real(self, xx, way))
    cpu_linear.set_row_blocks(3)
    try:
        assert cpu_linear.row_block_threads() == 3
        with torch.inference_mode(inference):
            got = pack(x)
            small = pack(x[: cpu_linear.ROW_BLOCKS_MIN_ROWS - 1])
    finally:
        cpu_linear.set_row_blocks(None)
    assert cpu_linear.row_block_threads() == 1
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    under = cpu_linear.ROW_BLOCKS_MIN_ROWS - 1
    torch.testing.assert_close(small, torch.nn.functional.linear(x[:under], w, b), rtol=1e-5, atol=1e-4)
    block = cpu_linear.ROW_BLOCK
    blocks = -(-rows // block)
    assert sorted(calls[:blocks]) == sorted([block] * (rows // block) + ([rows % block] if rows % block else []))
    assert calls[blocks:] == [under]  # under the threshold: one call


def test_a_failing_row_block_raises_in_the_caller(monkeypatch):
    pack = cpu_linear.PackedLinear(torch.randn(8, 4), None)

    def boom(self, x, way):
        raise RuntimeError("block failed")

    monkeypatch.setattr(cpu_linear.PackedLinear, "compute", boom)
    cpu_linear.set_row_blocks(2)
    try:
        with pytest.raises(RuntimeError, match="block failed"):
            pack(torch.randn(1024, 4))
    finally:
        cpu_linear.set_row_blocks(None)
    with pytest.raises(ValueError, match=">= 1"):
        cpu_linear.set_row_blocks(0)
