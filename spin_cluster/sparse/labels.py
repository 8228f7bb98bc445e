"""labels: a label cache (after Double Sparsity, 2024). Every key is kept on the GPU in r
fixed channels of its KV head, and a page scores its best token::

    score(p) = max_{t in p, written} (sum_g q_g)[c] . k_t[c]      c: the head's r channels

The channels are chosen once per (layer, KV head) from the weights: the RoPE pairs (d, d + D/2)
with the largest ``||W_k[d]|| * sum_g ||W_q[g, d]||`` (RoPE rotates within a pair, so a pair's
magnitude survives it; ``channels.weight_channels``). A model without a weights file (random
weights for speed runs) gets evenly spaced pairs. ``sparse.options.channels``: r, even, or a
fraction of D under 1 (0.5: D/2, whatever the model's D), default D/4.

Where Quest bounds a page by a box around its keys, which in 64-128 dimensions is far larger
than any key in it, this scores the keys themselves. At 2K on SmolLM2 and 1/16 of the
context, r = 16 of 64 channels scored 73 against dense 75 and Quest 19 (``docs/accuracy.md``,
"Scoring keys one by one"). The price is the index: r/D of the K cache, read whole by every
Select, against Quest's 2/S.

An 8-bit index (``index_dtype: float8_e4m3fn``): the labels are values, not bounds, so they
round to nearest, clamped to e4m3's +-448. The bundled ``spin`` config keeps r = D/4 in e4m3:
the same Gemma-3-270M pass keys as float32 and bfloat16, and at 4 x 128K on an H100 69.8 us of
scoring a layer against 108.1 in bfloat16 and 189.5 in float32 (``docs/performance.md``).

Index layout: ``labels`` [L, R * P * S + 1, Hkv, r] in ``index_dtype`` (row-major over request
rows and token positions; the last row absorbs masked-off writes, and is the one token of
the cache's padding row, row R, ``OffloadedKVManager.padding_row``); ``lengths`` [R + 1] tokens
written per row, updated once per step in ``plan_append``. On CUDA a layer's labels are
written in one Triton launch (``kernels.page_select.label_append``), the query's channels
taken in one (``label_query``) and scored in one (``label_scores``: a program per request
and page for all KV heads, so that it reads the index in contiguous runs, with the
hysteresis added in the same program); every op is fixed-shape, so decode steps run in CUDA
graphs.
"""

from __future__ import annotations

import os

import torch

from spin_cluster.kernels.page_select import label_append, label_query, label_scores
from spin_cluster.sparse.channels import weight_channels
from spin_cluster.sparse.contract import SparseAlgorithm, register
from spin_cluster.sparse.select import select_pages


def label_channels(channels: float, head_dim: int) -> int:
    """r of ``sparse.options.channels``: 0 -> D/4 (at least 2); a fraction under 1 -> that
    share of D, rounded to an even count (RoPE pairs); else the count itself, even and in
    2..D."""
    if channels == 0:
        return max(2, head_dim // 4)
    if 0 < channels < 1:
        return max(2, 2 * round(head_dim * channels / 2))
    if channels != int(channels) or channels % 2 or not 2 <= channels <= head_dim:
        raise ValueError(f"sparse.options.channels={channels}: must be even and in 2..{head_dim}, or a fraction "
                         "of D under 1 (0: D/4)")
    return int(channels)


@register
class Labels(SparseAlgorithm):
    name = "labels"
    graph_safe = True
    index_dtypes = ("float32", "bfloat16", "float16", "float8_e4m3fn")

    def __init__(self, channels: float = 0, model_path: str | None = None, **kw) -> None:
        super().__init__(**kw)
        D = self.head_dim
        r = self.channels = label_channels(channels, D)
        if model_path and os.path.exists(os.path.join(model_path, "model.safetensors")):
            ids = weight_channels(model_path, self.model_layers, self.num_kv_heads, D, r)
        else:  # no weights to rank the channels by: evenly spaced RoPE pairs
            half = torch.arange(r // 2) * (D // 2) // (r // 2)
            ids = torch.cat([half, half + D // 2]).expand(self.num_layers, self.num_kv_heads, r)
        self.channel_ids = ids.contiguous().to(self.device)  # [L, Hkv, r]
        self.span = self.max_pages_per_seq * self.page_size  # token positions per request row
        n = self.max_seqs * self.span + 1
        self.labels = torch.zeros(self.num_layers, n, self.num_kv_heads, r, dtype=self.index_dtype, device=self.device)
        self.lengths = torch.zeros(self.max_seqs + 1, dtype=torch.long, device=self.device)

    def index_bytes_per_token(self) -> float:
        # r channels of every key
        return self.num_layers * self.num_kv_heads * self.channels * self.labels.element_size()

    def on_append(self, layer, rows, positions, k):
        self.append(layer, self.plan_append(rows, positions), k)

    def plan_append(self, rows, positions, decode_only=False):
        """Once per step: each row's written length (a request starting at position 0 resets
        it), and the flat label slot of each token."""
        self.lengths.index_fill_(0, torch.where(positions == 0, rows, self.max_seqs), 0)
        self.lengths.scatter_reduce_(0, rows, positions + 1, "amax")
        return rows * self.span + positions

    def append(self, layer, plan, k):
        # k: [T, Hkv, D] -> its labels [T, Hkv, r] at rows ``plan`` (one launch on CUDA)
        label_append(self.labels[layer], k, self.channel_ids[layer], plan)

    def query_labels(self, layer, q):
        """q [B, H, D] -> [B, Hkv, r]: the query summed over each KV head's query heads, in the
        head's label channels (what a label is scored against); one launch on CUDA."""
        return label_query(q, self.channel_ids[layer])

    def score(self, layer, q, rows, num_pages, held=None, margin=0.0):
        # q: [B, H, D] -> [B, Hkv, num_pages]; ``margin`` added to the ``held`` pages
        return label_scores(self.query_labels(layer, q), self.labels[layer], rows, self.lengths, self.span, num_pages,
                            self.page_size, held, margin)

    def select_top(self, layer, q, rows, plan, held, margin, force=False):
        # With the hysteresis on CUDA: its margin added in the scoring launch, then the top-k
        # as the separate steps take it (two launches a layer fewer, the same pages).
        if held is None or not (q.is_cuda or force):
            return None
        return select_pages(self.score(layer, q, rows, plan.max_pages, held, margin), False, plan, self.num_kv_heads)
