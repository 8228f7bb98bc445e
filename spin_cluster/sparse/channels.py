"""The channels of a KV head that attention weighs most, from the model's weights: what a
label cache (``labels``) keeps of every key, r of the head's D channels.

Per (layer, KV head), a channel d weighs ``||W_k[d]|| * sum_g ||W_q[g, d]||`` (the G query
heads summed), and channels go in RoPE pairs (d, d + D/2): RoPE rotates within a pair, so a
pair's magnitude survives it. A model with per-head q/k norms (Gemma 3, Qwen3) scales channel
d of q and k by its norm weight after the projection (Gemma 3: by 1 + weight), so each side's
norm is multiplied by that scale's magnitude: the channels attention weighs most are those of
the normed q and k, not of the projections alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def weight_channels(model_path: str, layers: Sequence[int], num_kv_heads: int, head_dim: int, r: int) -> torch.Tensor:
    """[L, Hkv, r] channels of each KV head of the model's ``layers`` (L of them) with the
    largest q.k weight norms, in RoPE pairs."""
    from safetensors import safe_open

    D, half = head_dim, head_dim // 2
    offset = _qk_norm_offset(model_path)
    out = torch.empty(len(layers), num_kv_heads, r, dtype=torch.long)
    with safe_open(f"{model_path}/model.safetensors", "pt") as f:
        names = set(f.keys())
        for i, layer in enumerate(layers):
            at = f"model.layers.{layer}.self_attn"
            wq = f.get_tensor(f"{at}.q_proj.weight").float()  # [H*D, E]
            wk = f.get_tensor(f"{at}.k_proj.weight").float()  # [Hkv*D, E]
            q_norm = wq.norm(dim=1).view(num_kv_heads, -1, D)  # [Hkv, G, D]
            k_norm = wk.norm(dim=1).view(num_kv_heads, D)
            if f"{at}.q_norm.weight" in names:  # the per-head norms' channel scales, [D] each
                q_norm = q_norm * (offset + f.get_tensor(f"{at}.q_norm.weight").float()).abs()
                k_norm = k_norm * (offset + f.get_tensor(f"{at}.k_norm.weight").float()).abs()
            score = q_norm.sum(1) * k_norm  # [Hkv, D], q summed over G
            pair = score[:, :half] + score[:, half:]  # [Hkv, D/2]
            top = pair.topk(r // 2, dim=-1).indices  # [Hkv, r/2]
            out[i] = torch.cat([top, top + half], dim=-1)
    return out


def _qk_norm_offset(model_path: str) -> float:
    """What a q/k norm adds to its weight before scaling: 1 for Gemma 3 (``1 + weight``), else 0."""
    from spin_cluster.models.config import ModelConfig

    if not os.path.exists(os.path.join(model_path, "config.json")):
        return 0.0
    return 1.0 if ModelConfig.from_folder(model_path).model_type == "gemma3_text" else 0.0
