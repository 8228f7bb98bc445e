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


def test_one_or_two_rows_take_the_plain_weight(monkeypatch):
    # M <= _PLAIN_MAX_ROWS: the plain weight (the native kernel where built, else bitwise
    # F.linear); the pack (oneDNN) above it
    calls, native = [], []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a), raising=False)
    real_rows = cpu_linear.cpu_native.linear_rows
    monkeypatch.setattr(cpu_linear.cpu_native, "linear_rows", lambda x, *a: native.append(x.shape[0]) or real_rows(x, *a))
    lin = nn.Linear(96, 160)
    assert cpu_linear.pack(lin)
    for m in range(1, cpu_linear._PLAIN_MAX_ROWS + 2):
        x = torch.randn(m, 96)
        y = cpu_linear.linear(lin, x)
        want = nn.functional.linear(x, lin.weight, lin.bias)
        if m <= cpu_linear._PLAIN_MAX_ROWS and not cpu_linear._native_rows():
            assert torch.equal(y, want)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert calls == [cpu_linear._PLAIN_MAX_ROWS + 1]
    assert native == (list(range(1, cpu_linear._PLAIN_MAX_ROWS + 1)) if cpu_linear._native_rows() else [])


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


def test_the_engine_packs_only_when_asked(tiny_llama_path):
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams

    outs = {}
    for packed in (False, True):
        cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 128,
                         "cpu_packed_gemms": packed}, "cache": {"kv_cache_gib": 0.01}}
        engine = Engine(SpinConfig.from_dict(cfg), progress=False)
        assert (getattr(engine.model.lm_head, "cpu_pack", None) is not None) is packed
        outs[packed] = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(outs[True][0].token_ids) == len(outs[False][0].token_ids) == 6
