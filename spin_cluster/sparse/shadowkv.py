"""shadowkv: one landmark per page (the mean of its post-RoPE keys) plus outlier pages that
always rank first (ShadowKV, 2024).

ShadowKV splits the context into chunks, keeps each chunk's mean post-RoPE key as a landmark,
and attends to the chunks with the largest q . landmark. Chunks whose keys the mean describes
badly ("outliers", about 0.3% of them) are kept on the GPU and always attended. Here a chunk
is a page, per (request, layer, KV head)::

    landmark(p) = sum_t k_t / n_p                            n_p tokens written to page p
    spread(p)   = 1 - n_p |landmark(p)|^2 / sum_t |k_t|^2    energy share the mean misses, 0..1
    score(p)    = (sum_g q_g) . landmark(p)                  summed over the G query heads
    outliers    = the ceil(outlier_fraction * full pages) full pages of largest spread

Outliers are lifted above every other page (score + 2 max|score| + 1), so Select takes them
first within the budget and still orders them by score among themselves.

Deviations from the paper:

* ShadowKV computes an SVD of the prefill's PRE-RoPE keys and stores the key cache itself in
  that rank-r form, reconstructing selected keys on the fly. Here the host tier keeps full
  keys (Attention and Retrieve are the system's) and ``on_append`` only sees post-RoPE keys, so
  there is no low-rank key cache and landmarks keep full width D. A rank-r landmark would
  need a [D, r] basis per (request, layer, head) from the first prefill chunk's keys; building
  it needs a per-request prefill hook (or a phase flag): an SVD per decode step would cost more
  than it saves.
* ShadowKV ranks chunks by the lowest cosine similarity between a key and the chunk mean,
  which needs every key against the final mean. ``spread`` is its accumulable stand-in: the
  keys' energy orthogonal to the mean, from two running sums.
* Outliers are chosen at every Select among all full pages (prefill and decode), and they take
  budget rather than sitting in extra GPU memory beside it.

Index layout, per layer: ``sums`` [R * P + 1, Hkv, D + 1]: the running sum of the page's keys
[..., :D] and of their squared norms [..., D]; the extra last row absorbs masked-off writes so
that updates keep fixed shapes. ``lengths`` [R + 1]: tokens written per request row (the last
entry is the same kind of dump), shared by all layers.
"""

from __future__ import annotations

import math

import torch

from spin_cluster.sparse.contract import SparseAlgorithm, register


@register
class ShadowKV(SparseAlgorithm):
    name = "shadowkv"
    # Share of a request's full pages kept as outliers, per KV head (ShadowKV: ~0.3% of chunks).
    outlier_fraction = 1 / 256

    def __init__(self, *, outlier_fraction: float | None = None, **kw) -> None:
        super().__init__(**kw)
        self.outlier_fraction = type(self).outlier_fraction if outlier_fraction is None else outlier_fraction
        if not 0 <= self.outlier_fraction <= 1:
            raise ValueError(f"shadowkv outlier_fraction={self.outlier_fraction}: use a share in [0, 1]")
        n = self.max_seqs * self.max_pages_per_seq + 1
        shape = (self.num_layers, n, self.num_kv_heads, self.head_dim + 1)
        self.sums = torch.zeros(shape, dtype=self.index_dtype, device=self.device)
        self.lengths = torch.zeros(self.max_seqs + 1, dtype=torch.long, device=self.device)

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        P, S = self.max_pages_per_seq, self.page_size
        idx = rows * P + positions // S  # [T] flat page index
        first = positions % S == 0  # a page's first token: forget what a previous owner left
        sums = self.sums[layer]
        sums.index_fill_(0, torch.where(first, idx, sums.shape[0] - 1), 0.0)
        kf = k.float()
        energy = kf.square().sum(-1, keepdim=True)  # [T, Hkv, 1]
        sums.index_add_(0, idx, torch.cat([kf, energy], -1).to(sums.dtype))
        # Every layer sees the same rows and positions, so repeating this per layer is harmless.
        self.lengths.index_fill_(0, torch.where(positions == 0, rows, self.max_seqs), 0)
        self.lengths.scatter_reduce_(0, rows, positions + 1, "amax")

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        Hkv, S, P = self.num_kv_heads, self.page_size, self.max_pages_per_seq
        p = torch.arange(num_pages, device=q.device)
        sums = self.sums[layer][rows[:, None] * P + p].float()  # [B, P', Hkv, D+1]
        count = (self.lengths[rows][:, None] - p * S).clamp(0, S)  # [B, P'] tokens in each page
        n = count.clamp(min=1)[:, :, None].float()  # [B, P', 1]
        landmark = sums[..., :D] / n[..., None]  # [B, P', Hkv, D]
        q_sum = q.float().view(B, Hkv, H // Hkv, D).sum(2)  # [B, Hkv, D]
        scores = torch.einsum("bhd,bphd->bhp", q_sum, landmark)  # [B, Hkv, P']
        spread = 1 - n * landmark.square().sum(-1) / sums[..., D].clamp(min=torch.finfo(torch.float32).tiny)
        return self._lift_outliers(scores, spread.transpose(1, 2), count == S)

    def _lift_outliers(self, scores: torch.Tensor, spread: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """scores, spread [B, Hkv, P']; full [B, P'] pages with all S tokens -> lifted scores."""
        most = math.ceil(self.outlier_fraction * scores.shape[-1])
        if most == 0:
            return scores
        spread = torch.where(full[:, None, :], spread, -1.0)  # partial pages are never outliers
        top = spread.topk(most, dim=-1)  # [B, Hkv, most]
        quota = (full.sum(-1) * self.outlier_fraction).ceil()  # [B] outliers each request may have
        rank = torch.arange(most, device=scores.device)
        take = (rank < quota[:, None, None]) & (top.values >= 0)  # [B, Hkv, most]
        outlier = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, take)
        lift = 2 * scores.abs().amax(-1, keepdim=True) + 1  # above every page that is not lifted
        return torch.where(outlier, scores + lift, scores)
