"""Cut a loaded model down to one rank's attention heads (a pass over an unchanged model).

Per layer, the rank keeps the q/k/v projection rows of its KV heads and of their query
heads, and the matching input columns of o_proj; MLP, norms and embeddings stay whole::

    KV head h            -> k_proj/v_proj rows [h*D, (h+1)*D)
    its query heads      -> h*G .. h*G+G-1: q_proj rows and o_proj columns [qh*D, (qh+1)*D)

The heads need not be contiguous, and a rank may own none in some layer (its projections
become empty and it contributes zeros). Each rank's o_proj then yields a partial sum of the
layer's output; ``HeadParallelOutput`` all-reduces it and adds the bias once. Local heads
keep ascending order, so local query head i still reads local KV head i // G.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spin_cluster.models import CausalLM


class HeadParallelOutput(nn.Module):
    """o_proj over this rank's heads, summed across ranks: [T, H_r*D] -> [T, E]."""

    def __init__(self, o_proj: nn.Linear, columns: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(o_proj.weight[:, columns].contiguous(), requires_grad=False)  # [E, H_r*D]
        self.bias = o_proj.bias  # [E] or None: added after the sum, so exactly once
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [T, E], this rank's share
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def shard_attention(model: CausalLM, kv_heads: Sequence[Sequence[int]], group=None) -> CausalLM:
    """In place: keep, in layer l, only KV heads ``kv_heads[l]`` (ascending) and their query heads."""
    mc = model.config
    if len(kv_heads) != mc.num_layers:
        raise ValueError(f"kv_heads gives {len(kv_heads)} layers, the model has {mc.num_layers}")
    G, D = mc.num_kv_groups, mc.head_dim
    for layer, heads in zip(model.layers, kv_heads):
        heads = list(heads)
        if heads != sorted(set(heads)) or any(not 0 <= h < mc.num_kv_heads for h in heads):
            raise ValueError(f"kv_heads of a layer must be ascending distinct ids in 0 .. {mc.num_kv_heads - 1}, got {heads}")
        attn = layer.self_attn
        device = attn.q_proj.weight.device
        kv_rows = _head_rows(heads, D, device)
        q_rows = _head_rows([h * G + g for h in heads for g in range(G)], D, device)
        for proj, rows in ((attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows)):
            _keep_rows(proj, rows)
        attn.o_proj = HeadParallelOutput(attn.o_proj, q_rows, group)
        attn.num_heads, attn.num_kv_heads = len(heads) * G, len(heads)
    return model


def _head_rows(heads: list[int], head_dim: int, device: torch.device) -> torch.Tensor:
    """Rows [h*D, (h+1)*D) of every head h, in order: [len(heads) * D] int64."""
    ids = torch.tensor(heads, dtype=torch.long, device=device)
    return (ids[:, None] * head_dim + torch.arange(head_dim, device=device)).reshape(-1)


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].contiguous(), requires_grad=False)
    linear.out_features = len(rows)
