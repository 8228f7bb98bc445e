"""The sparse budget: how many tokens and pages one KV head selects per decode step.

Every rule that turns ``sparse.budget`` (and its floor, sink, local window and per-head
budgets) into tokens or pages lives here; the cache builder sizes the GPU buffer from it,
the Spin backend plans each step's Select from it (``budget_tokens_on_device``), warm-up picks
its prompts' length from it, and S-HPLB's plan starts from it (``plan_config``)::

    a head's pages in one step, context of n tokens, pages of S tokens

      | sink |          middle: the budget          | local (tail page included) |
        ceil(sink_tokens/S)   ceil(budget_tokens(n)/S)   max(1, ceil(local_tokens/S))
        `----------------- edge pages: sink + local, whatever the budget --------'

    budget_tokens(n) = n                                   n <= floor (dense: every page)
                     = budget                              budget >= 1 (tokens)
                     = max(1, floor, int(budget * n))      budget in (0, 1)

Per-head budgets (``sparse.options.per_head_budgets``, [L][Hkv] tokens, an option of the
algorithms that score pages) replace the budget head by head; under top-p Select a layer's
heads share their budgets' sum, so one head may take it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spin_cluster.config import DEFAULT_BUDGET_FLOOR_TOKENS, SparseConfig
from spin_cluster.hplb import PlanConfig

if TYPE_CHECKING:
    from spin_cluster.config import SpinConfig
    from spin_cluster.models.config import ModelConfig


def floor_tokens(sparse: SparseConfig) -> int:
    """``sparse.budget_floor_tokens`` resolved: its default depends on the budget's form."""
    if sparse.budget_floor_tokens is not None:
        return sparse.budget_floor_tokens
    return DEFAULT_BUDGET_FLOOR_TOKENS if sparse.budget < 1 else 0


def budget_tokens(sparse: SparseConfig, context_tokens: int) -> int:
    """Middle tokens per head at ``context_tokens``: at or under the floor the context itself
    (every page: dense)."""
    floor = floor_tokens(sparse)
    if floor and context_tokens <= floor:
        return context_tokens
    if sparse.budget >= 1:
        return int(sparse.budget)
    return max(1, floor, int(sparse.budget * context_tokens))


def budget_tokens_on_device(sparse: SparseConfig, context: torch.Tensor) -> torch.Tensor:
    """``budget_tokens`` of each context [B] int64 on the device, with no host sync -> [B] int64."""
    budget, floor = sparse.budget, floor_tokens(sparse)
    if budget >= 1:
        tokens = torch.full_like(context, int(budget))
    else:
        tokens = (context.double() * budget).long().clamp_(min=max(1, floor))
    return torch.where(context <= floor, context, tokens) if floor else tokens


def sparse_context_tokens(sparse: SparseConfig) -> int:
    """The shortest context whose Select is as wide as a long request's: past the floor and
    twice a budget given in tokens."""
    fixed = int(sparse.budget) if sparse.budget >= 1 else 0
    return 2 * max(floor_tokens(sparse), fixed) + 1


def sink_pages(sink_tokens: int, page_size: int) -> int:
    return -(-sink_tokens // page_size)


def local_pages(local_tokens: int, page_size: int) -> int:
    """The local window's pages: at least one, the tail page being always local."""
    return max(1, -(-local_tokens // page_size))


@dataclass(frozen=True)
class PageBudget:
    """``sparse``'s budget over pages of ``page_size`` tokens, for a cache of ``num_kv_heads``
    KV heads a layer. ``selects_all``: the algorithm selects every page (dense), no budget."""

    sparse: SparseConfig
    page_size: int
    num_kv_heads: int
    selects_all: bool = False

    def __post_init__(self) -> None:
        # Select's top-p mass and the per-head budgets, read once: they live in the algorithm's
        # options, and a decode step should not parse the config (tests/engine/test_step_route.py).
        object.__setattr__(self, "top_p", self.sparse.top_p)
        object.__setattr__(self, "per_head_budgets", self.sparse.per_head_budgets)

    @property
    def sink_pages(self) -> int:
        return sink_pages(self.sparse.sink_tokens, self.page_size)

    @property
    def local_pages(self) -> int:
        return local_pages(self.sparse.local_tokens, self.page_size)

    @property
    def edge_pages(self) -> int:
        """Pages every head selects besides its budget: the sink's and the local window's (>= 1)."""
        return self.sink_pages + self.local_pages

    def pages(self, tokens):
        """Whole pages of ``tokens`` (an int, or an int tensor on the device)."""
        return -(-tokens // self.page_size)

    def budget_pages(self, context_tokens: int) -> int:
        return self.pages(budget_tokens(self.sparse, context_tokens))

    def floor_pages(self, context_tokens: int) -> int:
        """Pages of the longest context, of up to ``context_tokens``, that attends densely under
        the budget floor (0 with the floor off)."""
        return self.pages(min(context_tokens, floor_tokens(self.sparse)))

    def head_pages(self) -> list[list[int]] | None:
        """[L][Hkv] each head's budget in whole pages; None without per-head budgets."""
        rows = self.per_head_budgets
        return None if rows is None else [[self.pages(b) for b in row] for row in rows]

    def head_table(self, num_layers: int, device: torch.device) -> torch.Tensor | None:
        """``head_pages`` as a [L, Hkv] int64 table on ``device``, checked against the model's
        shape; None without per-head budgets."""
        rows = self.head_pages()
        if rows is None:
            return None
        table = torch.tensor(rows, dtype=torch.long)
        if tuple(table.shape) != (num_layers, self.num_kv_heads):
            raise ValueError(
                f"sparse.options.per_head_budgets is {list(table.shape)}; this model needs "
                f"[{num_layers}, {self.num_kv_heads}] (layers x KV heads)"
            )
        return table.to(device)

    def max_middle_pages(self, context_tokens: int) -> int:
        """Most middle pages one KV head may select per step in contexts of up to
        ``context_tokens``: its budget, the largest per-head budget, or under top-p the largest
        total of a layer's heads; and every page of a context at or under the budget floor."""
        rows, top_p = self.head_pages(), self.top_p is not None
        if rows is not None:
            most = max(sum(row) for row in rows) if top_p else max(max(row) for row in rows)
        else:
            pages = self.budget_pages(context_tokens)
            most = pages * self.num_kv_heads if top_p else pages
        return max(most, self.floor_pages(context_tokens))

    def mean_middle_pages(self, context_tokens: int) -> float:
        """Middle pages one KV head selects per step on average at ``context_tokens``: its
        budget, or the mean of the per-head budgets (under top-p, a layer's heads share their
        total: the same mean); at or under the budget floor, the context's every page."""
        rows = self.head_pages()
        if rows is not None and context_tokens > floor_tokens(self.sparse):
            return sum(map(sum, rows)) / sum(map(len, rows))
        return float(self.budget_pages(context_tokens))

    def mandatory_pages(self, context_tokens: int) -> int:
        """Pages a head selects per step at most in contexts of up to ``context_tokens``:
        sink + the widest budget + local (every page when the algorithm selects all)."""
        if self.selects_all:
            return self.pages(context_tokens)
        return self.edge_pages + self.max_middle_pages(context_tokens)

    def mean_attended_pages(self, context_tokens: int) -> float:
        """Pages a head attends per step on average over every layer and KV head: sink + its
        own budget + local (the bytes attention must read; per-head budgets differ, and the
        widest sizes ``mandatory_pages``)."""
        if self.selects_all:
            return float(self.mandatory_pages(context_tokens))
        return self.edge_pages + self.mean_middle_pages(context_tokens)

    def head_mandatory_pages(self, num_layers: int, max_pages: int) -> list[list[int]]:
        """[L][Hkv] pages each head selects per step under per-head budgets (top-k): sink + its
        own budget (every page of a context at the budget floor, at least) + local, at most
        ``max_pages``, as ``mandatory_pages`` counts the widest head's."""
        rows = self.head_pages()
        if len(rows) != num_layers:
            raise ValueError(f"sparse.options.per_head_budgets has {len(rows)} layers, the model {num_layers}")
        dense = self.floor_pages(max_pages * self.page_size)
        return [[min(max_pages, self.edge_pages + max(dense, pages)) for pages in row] for row in rows]


def plan_config(spin: SpinConfig, mc: ModelConfig, *, floor_fraction: float = 0.0, rounding: str = "up",
                method: str = "greedy") -> PlanConfig:
    """S-HPLB's plan of the engine: ``spin.sparse``'s budgets on ``mc``'s heads at the longest
    context (``model.max_model_len``, else the model's), capped per rank on the offloaded cache."""
    sp = spin.sparse
    context = spin.context_len(mc)
    return PlanConfig(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, num_kv_groups=mc.num_kv_groups,
                      context_tokens=context, budget_tokens=budget_tokens(sp, context), sink_tokens=sp.sink_tokens,
                      local_tokens=sp.local_tokens, dense_layers=sp.dense_layers, per_head_budgets=sp.per_head_budgets,
                      floor_fraction=floor_fraction, floor_tokens=floor_tokens(sp), rounding=rounding,
                      max_heads_per_rank=spin.cache.kind == "offloaded", method=method,
                      sparse_layers=mc.full_attention_layers())
