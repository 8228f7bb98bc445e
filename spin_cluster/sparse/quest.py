"""quest: per-page key bounds (element-wise min and max over the page's keys) as the index;
a page's score is the largest q.k any key inside those bounds could give (Quest, 2024).

    max over k in [kmin, kmax] of q.k = sum_d max(q_d kmin_d, q_d kmax_d)
                                      = q . (kmin + kmax) / 2 + |q| . (kmax - kmin) / 2

summed over the G query heads of each KV head, so Select is two batched mat-vecs per
layer instead of a [G, P, D] element-wise max.

Index layout, per layer: ``kmin``/``kmax`` [R * P + 1, Hkv, D] (row-major over request rows and
pages; the extra last row absorbs masked-off writes so that updates keep fixed shapes), in
``index_dtype``. A 16-bit index rounds outward (kmin down, kmax up, by at most one ulp of
slack) so that the bounds stay bounds; it halves the bytes Select reads, which at 128K tokens
and 2K budgets are more than Attention reads.
"""

from __future__ import annotations

import torch

from spin_cluster.kernels.page_select import page_scores, page_scores_ref
from spin_cluster.partition.contract import SparseAlgorithm, register


@register
class Quest(SparseAlgorithm):
    name = "quest"
    graph_safe = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        n = self.max_seqs * self.max_pages_per_seq + 1
        shape = (self.num_layers, n, self.num_kv_heads, self.head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=self.index_dtype, device=self.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=self.index_dtype, device=self.device)

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        self.append(layer, self.plan_append(rows, positions), k)

    def plan_append(self, rows, positions):
        """(flat page index of each token's K expanded to [T, Hkv, D], [T] rows to reset:
        the page's own index where a token starts a page, else the dump row)."""
        P, S = self.max_pages_per_seq, self.page_size
        idx = rows * P + positions // S  # [T] flat page index
        first = positions % S == 0  # a page's first token: forget what a previous owner left
        fresh = torch.where(first, idx, self.kmin.shape[1] - 1)
        return idx[:, None, None].expand(-1, self.num_kv_heads, self.head_dim), fresh

    def append(self, layer, plan, k):
        expanded, fresh = plan
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        kmin.index_fill_(0, fresh, float("inf"))
        kmax.index_fill_(0, fresh, float("-inf"))
        k = k.float()
        lo = hi = k
        if self.index_dtype != torch.float32:
            # Outward rounding to a 16-bit index: nearest rounding errs by <= 2^-8 relative
            # (bfloat16; 2^-11 for float16), so a 2^-7 relative margin keeps the bound.
            slack = k.abs() * (2.0 ** -7)
            lo, hi = (k - slack).to(self.index_dtype), (k + slack).to(self.index_dtype)
        kmin.scatter_reduce_(0, expanded, lo, "amin")
        kmax.scatter_reduce_(0, expanded, hi, "amax")

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]; Triton on CUDA, the torch reference elsewhere
        pages = rows[:, None] * self.max_pages_per_seq + torch.arange(num_pages, device=q.device)  # [B, P']
        fn = page_scores if q.device.type == "cuda" else page_scores_ref
        return fn(q, self.kmin[layer], self.kmax[layer], pages)
