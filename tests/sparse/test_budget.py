"""The sparse budget in tokens and pages (``spin_cluster.sparse.budget``), its one home."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from spin_cluster.config import SparseConfig, SpinConfig
from spin_cluster.sparse.budget import (PageBudget, budget_tokens, budget_tokens_on_device, floor_tokens,
                                        sparse_context_tokens)

REPO = Path(__file__).resolve().parents[2]


def test_the_budget_floor_defaults_to_2048_tokens_for_a_fraction_and_off_for_tokens():
    assert floor_tokens(SparseConfig(budget=0.0625)) == 2048
    assert floor_tokens(SparseConfig(budget=256)) == 0
    assert floor_tokens(SparseConfig(budget=256, budget_floor_tokens=1024)) == 1024
    assert floor_tokens(SparseConfig(budget=0.0625, budget_floor_tokens=0)) == 0
    # unresolved in the config, so that a replaced budget resolves it again
    cfg = SpinConfig.from_dict({"sparse": {"budget": 256}}).replace(sparse={"budget": 0.125})
    assert cfg.sparse.budget_floor_tokens is None and floor_tokens(cfg.sparse) == 2048


BUDGETS = [
    # a fraction: the context itself at or under the floor (dense), max(floor, fraction) above
    ({"budget": 0.0625}, {100: 100, 2048: 2048, 2049: 2048, 32768: 2048, 65536: 4096}),
    ({"budget": 0.0625, "budget_floor_tokens": 0}, {100: 6, 2048: 128, 65536: 4096}),
    ({"budget": 0.5, "budget_floor_tokens": 64}, {64: 64, 65: 64, 200: 100}),
    # tokens: dense at or under the floor, the budget as it is above (never raised)
    ({"budget": 256, "budget_floor_tokens": 1024}, {1000: 1000, 1024: 1024, 1025: 256}),
    ({"budget": 256}, {100: 256, 4096: 256}),
]


@pytest.mark.parametrize("sparse, expected", BUDGETS)
def test_budget_tokens_with_the_floor(sparse, expected):
    config = SparseConfig(**sparse)
    assert {n: budget_tokens(config, n) for n in expected} == expected


@pytest.mark.parametrize("sparse, expected", BUDGETS + [({"budget": 0.25, "budget_floor_tokens": 48}, {})])
def test_the_device_form_gives_the_same_tokens(sparse, expected):
    config = SparseConfig(**sparse)
    context = torch.tensor(sorted(set(range(1, 129)) | set(expected)))
    want = [budget_tokens(config, n) for n in context.tolist()]
    assert budget_tokens_on_device(config, context).tolist() == want


def test_edge_pages_are_the_sink_and_at_least_the_tail_page():
    assert PageBudget(SparseConfig(sink_tokens=16, local_tokens=64), 16, 2).edge_pages == 1 + 4
    assert PageBudget(SparseConfig(sink_tokens=0, local_tokens=0), 16, 2).edge_pages == 0 + 1
    assert PageBudget(SparseConfig(sink_tokens=17, local_tokens=1), 16, 2).edge_pages == 2 + 1


def test_mandatory_pages_take_the_widest_head_and_the_floor():
    # per-head budgets of 2, 0, 1 and 3 pages of 4 tokens; sink 1 page, local 2
    sparse = SparseConfig(algorithm="quest", options={"per_head_budgets": [[8, 0], [4, 12]]}, sink_tokens=4,
                          local_tokens=8, budget_floor_tokens=64)
    budget = PageBudget(sparse, 4, 2)
    assert budget.head_pages() == [[2, 0], [1, 3]]
    assert budget.mandatory_pages(128) == 1 + 16 + 2  # the floor's 16 pages outgrow the widest head
    assert budget.mean_attended_pages(64) == 1 + 16 + 2  # dense: the context's every page
    assert budget.mean_attended_pages(128) == 1 + 1.5 + 2  # above: each head its own budget
    assert budget.head_mandatory_pages(2, 40) == [[1 + 16 + 2] * 2] * 2
    assert budget.head_mandatory_pages(2, 10) == [[10, 10], [10, 10]]  # at most max_pages
    top_p = PageBudget(sparse.model_copy(update={"options": {**sparse.options, "top_p": 0.9},
                                                 "budget_floor_tokens": 0}), 4, 2)
    assert top_p.max_middle_pages(128) == 4  # a layer's heads share their sum: 1 + 3
    assert PageBudget(sparse, 4, 2, selects_all=True).mandatory_pages(130) == 33


def test_a_per_head_table_of_the_wrong_shape_names_the_right_one():
    budget = PageBudget(SparseConfig(algorithm="quest", options={"per_head_budgets": [[8, 0], [4, 12]]}), 4, 2)
    assert budget.head_table(2, torch.device("cpu")).tolist() == [[2, 0], [1, 3]]
    with pytest.raises(ValueError, match=r"this model needs \[3, 2\]"):
        budget.head_table(3, torch.device("cpu"))
    with pytest.raises(ValueError, match="has 2 layers, the model 3"):
        budget.head_mandatory_pages(3, 40)


def test_the_shortest_context_that_selects_as_a_long_one():
    assert sparse_context_tokens(SparseConfig(budget=0.0625)) == 2 * 2048 + 1
    assert sparse_context_tokens(SparseConfig(budget=256, budget_floor_tokens=0)) == 2 * 256 + 1
    assert sparse_context_tokens(SparseConfig(budget=4096, budget_floor_tokens=1024)) == 2 * 4096 + 1


# What only the budget's module computes: its functions, and pages of the sink or local window.
BUDGET_FUNCTIONS = {"budget_tokens", "floor_tokens", "floor_pages", "max_middle_pages", "mean_middle_pages",
                    "mandatory_pages", "edge_pages", "head_mandatory_pages", "sink_pages", "local_pages"}


def _hands_over(fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` calls the budget module's function of its name (a method that hands over)."""
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == fn.name
               for call in ast.walk(fn))


def _budget_copies(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in BUDGET_FUNCTIONS and not _hands_over(node):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} defines {node.name}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            for side in ast.walk(node):
                if isinstance(side, ast.Attribute) and side.attr in ("sink_tokens", "local_tokens", "budget_floor_tokens"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} divides {side.attr}")
    return found


def test_the_budget_arithmetic_has_one_home():
    home = REPO / "spin_cluster" / "sparse" / "budget.py"
    assert _budget_copies(home)  # the check sees the arithmetic where it is
    copies = [copy for folder in ("spin_cluster", "deployments", "profiling")
              for path in sorted((REPO / folder).rglob("*.py")) if path != home for copy in _budget_copies(path)]
    assert not copies, copies
