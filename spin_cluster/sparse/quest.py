"""quest: per-page key bounds (element-wise min and max over the page's keys) as the index;
a page's score is the largest q.k any key inside those bounds could give (Quest, 2024).

    max over k in [kmin, kmax] of q.k = sum_d max(q_d kmin_d, q_d kmax_d)
                                      = q . (kmin + kmax) / 2 + |q| . (kmax - kmin) / 2

summed over the G query heads of each KV head, so Select is two batched mat-vecs per
layer instead of a [G, P, D] element-wise max.

Index layout, per layer: ``kmin``/``kmax`` [R * P + 1, Hkv, D] (row-major over request rows and
pages; the extra last row absorbs masked-off writes so that updates keep fixed shapes).
"""

from __future__ import annotations

import torch

from spin_cluster.partition.contract import SparseAlgorithm, register


@register
class Quest(SparseAlgorithm):
    name = "quest"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        n = self.max_seqs * self.max_pages_per_seq + 1
        shape = (self.num_layers, n, self.num_kv_heads, self.head_dim)
        self.kmin = torch.full(shape, float("inf"), device=self.device)
        self.kmax = torch.full(shape, float("-inf"), device=self.device)

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        P, S = self.max_pages_per_seq, self.page_size
        idx = rows * P + positions // S  # [T] flat page index
        first = positions % S == 0  # a page's first token: forget what a previous owner left
        dump = self.kmin.shape[1] - 1
        fresh = torch.where(first, idx, dump)
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        kmin.index_fill_(0, fresh, float("inf"))
        kmax.index_fill_(0, fresh, float("-inf"))
        expanded = idx[:, None, None].expand_as(k)
        kmin.scatter_reduce_(0, expanded, k.float(), "amin")
        kmax.scatter_reduce_(0, expanded, k.float(), "amax")

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        G = H // self.num_kv_heads
        P = self.max_pages_per_seq
        pages = rows[:, None] * P + torch.arange(num_pages, device=q.device)  # [B, P']
        kmin = self.kmin[layer][pages]  # [B, P', Hkv, D]
        kmax = self.kmax[layer][pages]
        center = ((kmin + kmax) / 2).nan_to_num(0.0, posinf=0.0, neginf=0.0).permute(0, 2, 3, 1)  # [B, Hkv, D, P']
        radius = ((kmax - kmin) / 2).nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(min=0).permute(0, 2, 3, 1)
        qg = q.float().view(B, self.num_kv_heads, G, D)
        q_sum = qg.sum(2, keepdim=True)  # [B, Hkv, 1, D]
        q_abs = qg.abs().sum(2, keepdim=True)
        return (q_sum @ center + q_abs @ radius)[:, :, 0]  # [B, Hkv, P']
