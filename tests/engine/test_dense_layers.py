"""sparse.dense_layers: the first N layers attend over the whole context, the rest select."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine import spin_attention
from spin_cluster.sparse import select as sparse_select

PROMPTS = [list(range(1000, 1070)), list(range(2000, 2045))]  # 70 and 45 tokens: 18 and 12 pages of 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(path, **sparse):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 128},
        "cache": {"page_size": 4, "kind": "offloaded" if sparse else "paged"},
        "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64},
        "sparse": {"algorithm": "quest", "budget": 4, "sink_tokens": 4, "local_tokens": 4, **sparse} if sparse else {},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False)


def _tokens(engine):
    out = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    engine.check_integrity()
    return out


@pytest.fixture
def selects(monkeypatch):
    """Layers whose decode ran Select, in call order."""
    layers = []
    decode_layer = spin_attention.SpinAttention._decode_layer

    def recording(self, layer, *args):
        calls = len(select_calls)
        decode_layer(self, layer, *args)
        if len(select_calls) > calls:
            layers.append(layer)

    select_calls = []
    select = sparse_select.select_pages

    def counting(*args, **kwargs):
        select_calls.append(1)
        return select(*args, **kwargs)

    monkeypatch.setattr(sparse_select, "select_pages", counting)  # what select_layer calls
    monkeypatch.setattr(spin_attention.SpinAttention, "_decode_layer", recording)
    return layers


def test_every_layer_dense_gives_the_dense_tokens(tiny_llama_path, selects):
    dense = _tokens(_engine(tiny_llama_path))
    all_dense = _tokens(_engine(tiny_llama_path, dense_layers=2))  # the tiny Llama has 2 layers
    assert all_dense == dense and selects == []  # no Select anywhere


def test_only_the_later_layers_select(tiny_llama_path, selects):
    engine = _engine(tiny_llama_path, dense_layers=1)
    _tokens(engine)
    assert selects and set(selects) == {1}


def _first_decode_layer0(engine):
    """Layer 0's attention output at the first decode step of one prompt (its input token
    comes from the dense prefill, so it is the same in every engine)."""
    attn = engine.runner.attention
    forward, captured = attn.forward, []

    def capture(layer_id, q, k, v):
        out = forward(layer_id, q, k, v)
        if layer_id == 0 and attn.plan.num_decode and not captured:
            captured.append(out[: attn.plan.num_decode].clone())
        return out

    attn.forward = capture
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return captured[0]


def test_a_dense_first_layer_attends_exactly_where_a_tight_budget_does_not(tiny_llama_path):
    reference = _first_decode_layer0(_engine(tiny_llama_path))
    first_dense = _first_decode_layer0(_engine(tiny_llama_path, dense_layers=1))
    tight = _first_decode_layer0(_engine(tiny_llama_path, dense_layers=0))
    torch.testing.assert_close(first_dense, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tight, reference, rtol=1e-3, atol=1e-3)


def test_bad_dense_layers_are_refused(tiny_llama_path):
    with pytest.raises(ValueError, match="dense_layers"):
        SpinConfig.from_dict({"sparse": {"dense_layers": -1}})
    with pytest.raises(ValueError, match="the model has 2 layers"):
        _engine(tiny_llama_path, dense_layers=3)
