"""oracle: pages ranked by the attention mass the query really puts on them (an upper bound).

Not a serving algorithm: its index is a copy of every key, as large as the K cache itself.
It answers one question for the accuracy studies (``spin-cluster eval``): at a given budget,
what would a Select that knew the true attention recover? If the oracle fails a task at a
budget, no page-level Select can pass it there; if it passes where the others fail, their
estimates are what is missing. Per step and KV head::

    mass(p) = sum_g sum_{t in p} softmax_t(q_g . k_t / sqrt(D))     over the G query heads

Index layout, per layer: ``keys`` [R * P * S + 1, Hkv, D] (the last row absorbs masked-off
writes); ``lengths`` [R + 1] tokens written per request row, shared by all layers.
"""

from __future__ import annotations

import torch

from spin_cluster.sparse.contract import SparseAlgorithm, register


@register
class Oracle(SparseAlgorithm):
    name = "oracle"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        n = self.max_seqs * self.max_pages_per_seq * self.page_size + 1
        self.keys = torch.zeros(self.num_layers, n, self.num_kv_heads, self.head_dim, dtype=self.index_dtype,
                                device=self.device)
        self.lengths = torch.zeros(self.max_seqs + 1, dtype=torch.long, device=self.device)

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        span = self.max_pages_per_seq * self.page_size
        self.keys[layer].index_copy_(0, rows * span + positions, k.to(self.index_dtype))
        self.lengths.index_fill_(0, torch.where(positions == 0, rows, self.max_seqs), 0)
        self.lengths.scatter_reduce_(0, rows, positions + 1, "amax")

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        Hkv, S = self.num_kv_heads, self.page_size
        n = num_pages * S
        at = rows[:, None] * (self.max_pages_per_seq * S) + torch.arange(n, device=q.device)  # [B, n]
        k = self.keys[layer][at].float()  # [B, n, Hkv, D]
        qg = q.float().view(B, Hkv, H // Hkv, D)
        logits = torch.einsum("bhgd,bnhd->bhgn", qg, k) / D**0.5  # [B, Hkv, G, n]
        written = torch.arange(n, device=q.device) < self.lengths[rows][:, None]  # [B, n]
        logits = logits.masked_fill(~written[:, None, None, :], float("-inf"))
        mass = logits.softmax(-1).nan_to_num(0.0).sum(2)  # [B, Hkv, n]
        return mass.view(B, Hkv, num_pages, S).sum(-1)
