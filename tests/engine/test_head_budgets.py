"""The engine's Select honours S-HPLB per-head budgets and the online top-p rule."""

import pytest
import torch

from spin_cluster.algorithm_options import ScoredOptions
from spin_cluster.engine import SamplingParams
from spin_cluster.sparse import select as sparse_select
from spin_cluster.sparse.contract import SparseAlgorithm, register

PROMPT = list(range(1000, 1060))  # 60 tokens: 15 pages of 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@register
class _Peaked(SparseAlgorithm):
    """Test-only Select: KV head 0 puts all its score on page 1, the other heads score flat."""

    name = "_test_peaked"
    options_model = ScoredOptions  # it scores pages: top_p applies

    def score(self, layer, q, rows, num_pages):
        scores = torch.zeros(q.shape[0], self.num_kv_heads, num_pages, device=q.device)
        scores[:, 0, 1] = 1000.0
        return scores


@pytest.fixture
def selections(monkeypatch):
    """num_selected [Hkv] of every decode Select, in call order (layers in order per step)."""
    calls = []

    def recording(*args, **kwargs):
        want, num_selected = select(*args, **kwargs)
        calls.append(num_selected[0].tolist())
        return want, num_selected

    select = sparse_select.select_pages
    monkeypatch.setattr(sparse_select, "select_pages", recording)  # what select_layer calls
    return calls


def _run(engine):
    out = engine.generate([PROMPT], PARAMS)[0].token_ids
    engine.check_integrity()
    return out


def test_per_head_budgets_set_each_heads_middle_pages(offload_engine, selections):
    # tokens -> pages of 4: layer 0 heads take 2 and 0 middle pages, layer 1 heads 1 and 3
    _run(offload_engine({"algorithm": "quest", "options": {"per_head_budgets": [[8, 0], [4, 12]]}}))
    assert len(selections) == 2 * (PARAMS.max_tokens - 1)  # decode steps x layers
    assert selections[0::2] == [[1 + 2 + 2, 1 + 0 + 2]] * (PARAMS.max_tokens - 1)
    assert selections[1::2] == [[1 + 1 + 2, 1 + 3 + 2]] * (PARAMS.max_tokens - 1)


def test_equal_per_head_budgets_are_uniform_top_k(offload_engine):
    uniform = _run(offload_engine({"algorithm": "quest", "budget": 8}))
    per_head = _run(offload_engine({"algorithm": "quest", "options": {"per_head_budgets": [[8, 8], [8, 8]]}}))
    assert per_head == uniform


def test_top_p_lets_a_layers_heads_share_their_total(offload_engine, selections):
    # budget 8 tokens = 2 pages per head, 4 per layer: the peaked head needs 1, the flat head
    # would take 90% of ~12 middle pages but gets the other 3
    _run(offload_engine({"algorithm": "_test_peaked", "budget": 8, "options": {"top_p": 0.9}}))
    assert selections and all(s == [1 + 1 + 2, 1 + 3 + 2] for s in selections)


def test_top_p_reserves_the_layer_total_per_head_in_the_buffer(offload_engine):
    top_p = offload_engine({"algorithm": "quest", "budget": 8, "options": {"top_p": 0.9}})
    top_k = offload_engine({"algorithm": "quest", "budget": 8})
    pages = top_p.runner.attention.budget.mandatory_pages(64), top_k.runner.attention.budget.mandatory_pages(64)
    assert pages == (1 + 4 + 2, 1 + 2 + 2)


def test_mean_attended_pages_follow_each_heads_own_budget(offload_engine):
    # pages of 4 per head: 2, 0, 1, 3 middle pages (mean 1.5); the widest head sizes the buffer
    attn = offload_engine({"algorithm": "quest", "options": {"per_head_budgets": [[8, 0], [4, 12]]}}).runner.attention
    assert attn.budget.mandatory_pages(64) == 1 + 3 + 2
    assert attn.budget.mean_attended_pages(64) == 1 + 1.5 + 2
    uniform = offload_engine({"algorithm": "quest", "budget": 8}).runner.attention
    assert uniform.budget.mean_attended_pages(64) == uniform.budget.mandatory_pages(64) == 1 + 2 + 2
