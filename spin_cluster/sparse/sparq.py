"""sparq: pages scored by their strongest key, in the query's r largest channels (after
SparQ Attention, 2023). A study tool, like ``oracle``: its index is a copy of every key.

Per step, KV head and page p::

    score(p) = max_{t in p} sum_g  q_g[c_g] . k_t[c_g]      c_g: the r channels of largest |q_g|

At r = D this is the exact best key of the page, which Quest's bound reaches only for pages
of one token. It asks how much of Quest's gap to the oracle a Select would close by scoring
keys one by one at a fraction r/D of their bytes (``sparse.options.channels``, default D/4).
"""

from __future__ import annotations

import torch

from spin_cluster.partition.contract import register
from spin_cluster.sparse.oracle import Oracle


@register
class SparQ(Oracle):
    name = "sparq"

    def __init__(self, channels: int = 0, **kw) -> None:
        super().__init__(**kw)
        if not 0 <= channels <= self.head_dim:
            raise ValueError(f"sparse.options.channels={channels}: must be in 1..{self.head_dim} (0: D/4)")
        self.channels = channels or max(1, self.head_dim // 4)

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        B, H, D = q.shape
        Hkv, S, r = self.num_kv_heads, self.page_size, self.channels
        G, n = H // Hkv, num_pages * S
        at = rows[:, None] * (self.max_pages_per_seq * S) + torch.arange(n, device=q.device)  # [B, n]
        k = self.keys[layer][at].float().permute(0, 2, 1, 3)  # [B, Hkv, n, D]
        qg = q.float().view(B, Hkv, G, D)
        top = qg.abs().topk(r, dim=-1).indices  # [B, Hkv, G, r]
        q_r = qg.gather(-1, top)  # [B, Hkv, G, r]
        k_r = k[:, :, None].expand(B, Hkv, G, n, D).gather(-1, top[:, :, :, None].expand(B, Hkv, G, n, r))
        s = torch.einsum("bhgr,bhgnr->bhn", q_r, k_r)  # [B, Hkv, n] summed over the G query heads
        written = torch.arange(n, device=q.device) < self.lengths[rows][:, None]  # [B, n]
        s = s.masked_fill(~written[:, None, :], float("-inf"))
        return s.view(B, Hkv, num_pages, S).amax(-1)
