"""The budget floor (``sparse.budget_floor_tokens``): a request whose context is at or under it
attends densely, to dense's exact tokens; above it a fractional budget takes
max(floor, fraction x context) tokens per head."""

import pytest
import torch

from spin_cluster.engine import SamplingParams
from spin_cluster.sparse import select as sparse_select

S = 4  # page size (offload_engine): 1 sink page, 2 local pages
SHORT = list(range(1000, 1040))  # 40 tokens: decode contexts 41..45
LONG = list(range(2000, 2060))  # 60 tokens: decode contexts 61..65
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def selections(monkeypatch):
    """(context tokens [B], num_selected [B, Hkv]) of every decode Select, in call order."""
    calls = []

    def recording(scores, select_all, plan, num_kv_heads):
        want, num_selected = select(scores, select_all, plan, num_kv_heads)
        context = (plan.num_pages - 1) * S + plan.tail_len
        calls.append((context.tolist(), num_selected.tolist()))
        return want, num_selected

    select = sparse_select.select_pages
    monkeypatch.setattr(sparse_select, "select_pages", recording)  # what select_layer calls
    return calls


def _run(engine, prompts):
    out = [r.token_ids for r in engine.generate(prompts, PARAMS)]
    engine.check_integrity()
    return out


@pytest.mark.parametrize("sparse", [
    {"algorithm": "quest", "budget": 0.125},  # the default floor: 2048 tokens
    {"algorithm": "quest", "budget": 0.125, "budget_floor_tokens": 128},
    {"algorithm": "quest", "budget": 8, "budget_floor_tokens": 128},
    {"algorithm": "quest", "options": {"per_head_budgets": [[8, 0], [4, 12]]}, "budget_floor_tokens": 128},
    {"algorithm": "quest", "budget": 8, "options": {"top_p": 0.5}, "budget_floor_tokens": 128},
    {"algorithm": "streaming", "budget": 8, "budget_floor_tokens": 128},
], ids=["fraction", "fraction-128", "tokens", "per-head", "top-p", "streaming"])
def test_a_context_at_or_under_the_floor_gives_dense_tokens(offload_engine, selections, sparse):
    dense = _run(offload_engine({"algorithm": "dense"}, 128), [SHORT, LONG])
    selections.clear()
    assert _run(offload_engine(sparse, 128), [SHORT, LONG]) == dense
    assert selections, "no decode Select ran"
    for context, num_selected in selections:
        assert num_selected == [[-(-n // S)] * 2 for n in context]  # every page of every head


def test_the_same_fraction_without_a_floor_is_sparse(offload_engine, selections):
    """The test above can fail: at 1/8 with the floor off, Select keeps few of the pages."""
    _run(offload_engine({"algorithm": "quest", "budget": 0.125, "budget_floor_tokens": 0}), [LONG])
    assert selections and all(sel == [[1 + 2 + 2] * 2] for _, sel in selections)  # 8 tokens: 2 pages


@pytest.mark.parametrize("budget, floor, middle_pages", [
    (0.5, 16, 8),  # the fraction: 30..32 tokens, 8 pages
    (0.125, 40, 10),  # the floor: 40 tokens, 10 pages (the fraction is 7..8 tokens)
])
def test_above_the_floor_a_fraction_takes_max_floor_fraction(offload_engine, selections, budget, floor, middle_pages):
    _run(offload_engine({"algorithm": "quest", "budget": budget, "budget_floor_tokens": floor}), [LONG])
    assert selections and all(sel == [[1 + middle_pages + 2] * 2] for _, sel in selections)


def test_one_batch_mixes_dense_rows_under_the_floor_and_sparse_rows_above(offload_engine, selections):
    floor = 48  # SHORT's contexts are under it, LONG's above: 48 tokens, 12 middle pages
    engine = offload_engine({"algorithm": "quest", "budget": 0.125, "budget_floor_tokens": floor}, 128)
    _run(engine, [SHORT, LONG])
    mixed = [(context, sel) for context, sel in selections if len(context) == 2]
    assert mixed, "no decode step held both requests"
    for context, num_selected in mixed:
        assert num_selected == [[-(-n // S)] * 2 if n <= floor else [1 + 12 + 2] * 2 for n in context]


def test_the_step_budget_on_the_device_is_budget_tokens(offload_engine):
    from spin_cluster.sparse.budget import budget_tokens

    engine = offload_engine({"algorithm": "quest", "budget": 0.25, "budget_floor_tokens": 48})
    attention = engine.runner.attention
    positions = torch.arange(128)  # contexts 1..128
    want = [-(-budget_tokens(engine.config.sparse, n + 1) // 4) for n in range(128)]
    assert attention._decode_select(positions, 32).budget_pages[:, 0].tolist() == want


def test_shares_hold_every_page_of_a_context_at_the_floor(offload_engine):
    # per-head budgets of 2, 0, 1 and 3 pages; a floor of 64 tokens is 16 pages
    attention = offload_engine({"algorithm": "quest", "options": {"per_head_budgets": [[8, 0], [4, 12]]},
                                "budget_floor_tokens": 64}).runner.attention
    assert attention.budget.mandatory_pages(128) == 1 + 16 + 2
    assert attention.budget.mean_attended_pages(64) == 1 + 16 + 2  # dense: the context's every page
    assert attention.budget.mean_attended_pages(128) == 1 + 1.5 + 2  # above: each head its own budget
