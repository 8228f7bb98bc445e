"""Cut a loaded model down to one rank's share (a pass over an unchanged model).

Attention (``shard_attention``): per layer, the rank keeps the q/k/v projection rows of its
KV heads and of their query heads, and the matching input columns of o_proj::

    KV head h            -> k_proj/v_proj rows [h*D, (h+1)*D)
    its query heads      -> h*G .. h*G+G-1: q_proj rows and o_proj columns [qh*D, (qh+1)*D)

The heads need not be contiguous, and a rank may own none in some layer (its projections
become empty and it contributes zeros). Each rank's o_proj then yields a partial sum of the
layer's output; ``SummedLinear`` all-reduces it and adds the bias once. Local heads
keep ascending order, so local query head i still reads local KV head i // G.

MLP (``shard_mlp``): the rank keeps one contiguous block of the intermediate features, rows
of gate_proj and up_proj and the matching input columns of down_proj, whose partial sums
``SummedLinear`` all-reduces (tensor parallelism's column/row split). Without it every rank
would read the whole MLP, three quarters of the weights, at every decode step: at batch 2
that is a fixed cost no rank count divides. Norms, embeddings and lm_head stay whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spin_cluster.models import CausalLM


class SummedLinear(nn.Module):
    """A linear layer over this rank's input columns, summed across ranks: [T, C_r] -> [T, E]
    (o_proj over the rank's heads, down_proj over its intermediate features)."""

    def __init__(self, linear: nn.Linear, columns: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)  # [E, C_r]
        self.bias = linear.bias  # [E] or None: added after the sum, so exactly once
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
        attn.o_proj = SummedLinear(attn.o_proj, q_rows, group)
        attn.num_heads, attn.num_kv_heads = len(heads) * G, len(heads)
    return model


def mlp_block(intermediate_size: int, rank: int, num_ranks: int) -> range:
    """The intermediate features of ``rank``: contiguous blocks, the first F % R one larger."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside 0 .. {num_ranks - 1}")
    base, extra = divmod(intermediate_size, num_ranks)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def shard_mlp(model: CausalLM, rank: int, num_ranks: int, group=None) -> CausalLM:
    """In place: keep, in every layer, intermediate features ``mlp_block(F, rank, num_ranks)``."""
    for layer in model.layers:
        mlp = layer.mlp
        block = mlp_block(mlp.gate_proj.out_features, rank, num_ranks)
        rows = torch.arange(block.start, block.stop, device=mlp.gate_proj.weight.device)
        _keep_rows(mlp.gate_proj, rows)
        _keep_rows(mlp.up_proj, rows)
        mlp.down_proj = SummedLinear(mlp.down_proj, rows, group)
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
