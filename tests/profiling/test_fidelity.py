"""Attention fidelity: the tokens each method keeps, and the error measure, on a tiny model."""

import pytest
import torch

from spin_cluster.config import SparseConfig
from spin_cluster.models import load_model
from spin_cluster.profiling import fidelity
from spin_cluster.profiling.methods import Method

T, S = 100, 16  # 7 pages; the tail page holds 4 tokens


@pytest.fixture(scope="module")
def layers(tiny_llama_path):
    model = load_model(tiny_llama_path, dtype=torch.float32, device=torch.device("cpu"), progress=False).eval()
    ids = torch.randint(3, 1000, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    return fidelity.capture(model, ids)


def _mask(layers, method, sink=16, local=32):
    sparse = SparseConfig(**method.sparse_options(T, sink, local))
    return fidelity.selected_tokens(method, sparse, layers, S)  # [L, Hkv, T]


def test_capture_keeps_every_layer_and_the_last_query(layers):
    assert len(layers) == 2
    assert layers[0].q.shape == (4, 16) and layers[0].k.shape == (T, 2, 16) and layers[0].v.shape == (T, 2, 16)


def test_dense_keeps_everything_and_has_no_error(layers):
    mask = _mask(layers, Method("dense"))
    assert mask.all()
    err, rec = fidelity.compare(layers, mask)
    assert err.abs().max() < 1e-6 and torch.allclose(rec, torch.ones_like(rec))


def test_streaming_keeps_the_sink_page_and_a_window_widened_by_the_budget(layers):
    mask = _mask(layers, Method("streaming", 16))  # local 32 + 16 tokens -> 3 pages
    expect = torch.zeros(T, dtype=torch.bool)
    expect[:16] = True  # page 0
    expect[64:] = True  # pages 4, 5, 6 (the tail)
    assert torch.equal(mask, expect.expand_as(mask))


def test_quest_takes_its_budget_of_middle_pages_per_head(layers):
    mask = _mask(layers, Method("quest", 32))  # 2 middle pages among pages 1..4
    per_head = mask.sum(-1)  # sink 16 + 2 x 16 + pages 5, 6 (16 + 4)
    assert torch.equal(per_head, torch.full_like(per_head, 16 + 32 + 20))
    assert mask[..., :16].all() and mask[..., 80:].all()
    roomy = _mask(layers, Method("quest", 0.9))  # every middle page fits the budget
    assert roomy.all()


def test_error_of_attending_to_one_token_is_that_tokens_value(layers):
    mask = torch.zeros(len(layers), 2, T, dtype=torch.bool)
    mask[..., 7] = True
    err, rec = fidelity.compare(layers, mask)
    cap = layers[0]
    D = cap.q.shape[1]
    dense = torch.einsum("hd,thd->ht", cap.q, cap.k.repeat_interleave(2, dim=1)).mul(D**-0.5).softmax(-1)
    o = torch.einsum("ht,thd->hd", dense, cap.v.repeat_interleave(2, dim=1))
    want = (cap.v[7].repeat_interleave(2, dim=0) - o).norm(dim=-1) / o.norm(dim=-1)
    assert torch.allclose(err[0], want, atol=1e-5)
    assert torch.allclose(rec[0], dense[:, 7], atol=1e-6)


def test_rows_average_over_prompts(tiny_llama_path):
    model = load_model(tiny_llama_path, dtype=torch.float32, device=torch.device("cpu"), progress=False).eval()
    prompts = [(T, list(range(5, 5 + T))), (T, list(range(50, 50 + T)))]
    rows = fidelity.attention_fidelity(model, prompts, [Method("dense"), Method("streaming", 16)],
                                       sink_tokens=16, local_tokens=32, page_size=S)
    assert [(r.method, r.length, r.num_prompts) for r in rows] == [("dense", T, 2), ("streaming 16 tok", T, 2)]
    assert rows[0].rel_l2_error == pytest.approx(0.0, abs=1e-6) and rows[0].attention_recall == pytest.approx(1.0)
    assert 0 < rows[1].rel_l2_error and 0 < rows[1].attention_recall < 1
