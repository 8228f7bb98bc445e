"""labels+quest: a page is kept if either of two rankings keeps it.

``labels`` scores a page by its best key on r channels, Quest by a box around its keys; at 4K
on SmolLM2 each lost needles the other found (``docs/accuracy.md``). This Select ranks the
pages of each head by both and fuses the ranks::

    score(p) = -(min(rank_labels(p), rank_quest(p)) + max(rank_labels(p), rank_quest(p)) / (P + 1))

so that a top-k of the fused score is the union of each ranking's first j pages, j as large
as the budget allows (at least k / 2), ties going to the page both rank higher. Both indexes
are kept (their bytes add up: ``index_bytes_per_token``), and each Select reads both.

A score here is a rank, not a logit: ``sparse.options.resident_margin`` (logits, scaled to score
units by G sqrt(D)) becomes that many places of rank, e.g. 12 places at 0.5 nats for 3 query
heads per KV head of D 64. Options: labels' ``channels``; ``quest_layers`` and
``labels_layers`` (layer indices, a list or "5,11"): layers ranked by that one Select alone
(its ranks, so the margin keeps its meaning), chosen by measured recall where one ranking keeps
less attention mass than the other (``profiling/diagnose.py``); the other layers take both.
Both indexes are kept at every layer either way.
"""

from __future__ import annotations

import torch

from spin_cluster.sparse.contract import SparseAlgorithm, register
from spin_cluster.sparse.labels import Labels
from spin_cluster.sparse.quest import Quest


def page_ranks(scores: torch.Tensor) -> torch.Tensor:
    """[.., P] scores -> [.., P] int64 rank of each page (0: the highest score; NaN counts as
    -inf; ties by page order). Two kernels, no host sync."""
    order = scores.nan_to_num(nan=float("-inf")).argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    return ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))


def fuse_ranks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two [.., P] score tensors -> [.., P] float32 scores whose top k pages are the union of
    each one's best pages (the module docstring's formula)."""
    ra, rb = page_ranks(a), page_ranks(b)
    return -(torch.minimum(ra, rb) + torch.maximum(ra, rb) / (a.shape[-1] + 1)).float()


@register
class LabelsQuest(SparseAlgorithm):
    name = "labels+quest"
    graph_safe = True

    def __init__(self, channels: float = 0, model_path: str | None = None, quest_layers=(), labels_layers=(),
                 **kw) -> None:
        super().__init__(**kw)
        self.labels = Labels(channels=channels, model_path=model_path, **kw)
        self.quest = Quest(**kw)
        # The options name the model's layers (as ``diagnose`` reports them); the index serves
        # ``model_layers`` (a Gemma 3 model's global layers only), and Select passes its position.
        quest, labels = _layers(quest_layers, "quest"), _layers(labels_layers, "labels")
        bad = sorted((quest | labels) - set(self.model_layers))
        if bad:
            raise ValueError(f"sparse.options: layers {bad} are not layers this index serves {list(self.model_layers)}")
        both = sorted(quest & labels)
        if both:
            raise ValueError(f"sparse.options: layers {both} are in both quest_layers and labels_layers")
        self.quest_layers = frozenset(i for i, m in enumerate(self.model_layers) if m in quest)
        self.labels_layers = frozenset(i for i, m in enumerate(self.model_layers) if m in labels)

    def index_bytes_per_token(self) -> float:
        return self.labels.index_bytes_per_token() + self.quest.index_bytes_per_token()

    def index_bytes_held_per_token(self) -> float:
        return self.labels.index_bytes_held_per_token() + self.quest.index_bytes_held_per_token()

    def on_append(self, layer, rows, positions, k):
        self.append(layer, self.plan_append(rows, positions), k)

    def plan_append(self, rows, positions, decode_only=False):
        return self.labels.plan_append(rows, positions), self.quest.plan_append(rows, positions, decode_only)

    def append(self, layer, plan, k):
        self.labels.append(layer, plan[0], k)
        self.quest.append(layer, plan[1], k)

    def on_free(self, row):
        self.labels.on_free(row)
        self.quest.on_free(row)

    def score(self, layer, q, rows, num_pages):
        if layer in self.quest_layers:
            return -page_ranks(self.quest.score(layer, q, rows, num_pages)).float()
        if layer in self.labels_layers:
            return -page_ranks(self.labels.score(layer, q, rows, num_pages)).float()
        return fuse_ranks(self.labels.score(layer, q, rows, num_pages), self.quest.score(layer, q, rows, num_pages))


def _layers(value, name: str) -> frozenset[int]:
    """Layer indices from an int, a list of ints or a comma-separated string ("5,11")."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    elif isinstance(value, int):
        value = [value]
    try:
        return frozenset(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"sparse.options.{name}_layers={value!r}: layer indices, e.g. [5, 11] or \"5,11\"") from None
