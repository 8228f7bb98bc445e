"""sparq: pages scored by their strongest key, in the query's r largest channels (after
SparQ Attention, 2023). A study tool, like ``oracle``: its index is a copy of every key.

Per step, KV head and page p::

    score(p) = max_{t in p} sum_g  q_g[c_g] . k_t[c_g]      c_g: the r channels of largest |q_g|

At r = D this is the exact best key of the page, which Quest's bound reaches only for pages
of one token. It asks how much of Quest's gap to the oracle a Select would close by scoring
keys one by one at a fraction r/D of their bytes (``sparse.options.channels``, default D/4).

``sparse.options.fixed_channels: true`` picks each (layer, KV head)'s r channels once, from
the weights, instead of per query: the RoPE pairs (d, d + D/2) with the largest
``||W_k[d]|| * sum_g ||W_q[g, d]||`` summed over the pair (RoPE rotates within a pair, so a pair's
magnitude survives it; ``sparse.channels.weight_channels``). Fixed channels are what a GPU
index could store contiguously, r per token (Double Sparsity's "label cache", served as
``labels``).
"""

from __future__ import annotations

import torch

from spin_cluster.profiling.oracle import Oracle
from spin_cluster.sparse.channels import weight_channels
from spin_cluster.sparse.contract import register


@register
class SparQ(Oracle):
    name = "sparq"

    def __init__(self, channels: int = 0, fixed_channels: bool = False, model_path: str | None = None, **kw) -> None:
        super().__init__(**kw)
        if not 0 <= channels <= self.head_dim:
            raise ValueError(f"sparse.options.channels={channels}: must be in 1..{self.head_dim} (0: D/4)")
        self.channels = channels or max(1, self.head_dim // 4)
        self.fixed = None  # [L, Hkv, r] channel ids, or None: the query's top-r per step
        if fixed_channels:
            if self.channels % 2 or model_path is None:
                raise ValueError("sparse.options.fixed_channels needs an even channel count and the model's weights")
            self.fixed = weight_channels(model_path, self.model_layers, self.num_kv_heads, self.head_dim,
                                         self.channels).to(self.device)

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        Hkv, S, r = self.num_kv_heads, self.page_size, self.channels
        G, n = H // Hkv, num_pages * S
        at = rows[:, None] * (self.max_pages_per_seq * S) + torch.arange(n, device=q.device)  # [B, n]
        k = self.keys[layer][at].float().permute(0, 2, 1, 3)  # [B, Hkv, n, D]
        qg = q.float().view(B, Hkv, G, D)
        if self.fixed is None:
            top = qg.abs().topk(r, dim=-1).indices  # [B, Hkv, G, r]
        else:
            top = self.fixed[layer][None, :, None].expand(B, Hkv, G, r)
        q_r = qg.gather(-1, top)  # [B, Hkv, G, r]
        k_r = k[:, :, None].expand(B, Hkv, G, n, D).gather(-1, top[:, :, :, None].expand(B, Hkv, G, n, r))
        s = torch.einsum("bhgr,bhgnr->bhn", q_r, k_r)  # [B, Hkv, n] summed over the G query heads
        written = torch.arange(n, device=q.device) < self.lengths[rows][:, None]  # [B, n]
        s = s.masked_fill(~written[:, None, :], float("-inf"))
        return s.view(B, Hkv, num_pages, S).amax(-1)

