"""The contract between a model's forward and whoever owns the KV cache.

A model never sees pages, tables or tiers. Each attention layer hands its projected, rotated
q/k/v for the tokens of this step to a ``LayerAttention``; whoever implements it stores k/v
wherever the cache lives and returns the attention output. The engine's attention backends
(``spin_cluster.engine.backend.AttentionBackend``, which adds the step's plan), the offline
profilers' recorders and the contiguous test backend all implement this one method.

Shapes (one letter set, see STYLE.md): T tokens in this step (all requests flattened),
H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerAttention(Protocol):
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        """Store k/v for this step's tokens and attend.

        q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, D], all after RoPE (and q/k norm).
        Returns [T, H, D] in q's dtype. Softmax scale is D ** -0.5.
        window: a sliding-window layer's (Gemma 3): a query at position p sees only keys at
        p - window + 1 .. p. Models pass it only for such layers, so a backend that cannot
        mask a window fails on them rather than attending to every key.
        The backend knows, from its own per-step plan, which request and position each of
        the T tokens belongs to; the model passes no such metadata.
        """
        ...
