"""The causal LM for Llama, Qwen2 and Qwen3 checkpoints (one module; the differences are
config flags: q/k/v bias, per-head q/k norm, head_dim, RoPE scaling, tied embeddings).

Module names follow the checkpoint's tensor names with the leading ``model.`` dropped:
``embed_tokens``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``lm_head``.

Shapes (one letter set): T tokens of this step, all requests flattened; N rows to score;
E hidden size; V vocab size; D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from spin_cluster.models import cpu_linear
from spin_cluster.models.base import LayerAttention
from spin_cluster.models.config import ModelConfig
from spin_cluster.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class DecoderLM(nn.Module):
    """What every causal LM module here shares: embed_tokens [V, E], a stack of ``layers``
    (each with ``self_attn`` and ``mlp`` that can ``fuse``), lm_head [E] -> [V] and its
    tying, the fused and CPU-packed GEMMs, dtype and device."""

    config: ModelConfig

    def tie_weights(self) -> None:
        """lm_head shares embed_tokens' [V, E] matrix (a no-op when the config does not tie)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def fuse_projections(self) -> "DecoderLM":
        """Every layer's q/k/v and gate/up projections as one GEMM each (``FusedLinears``).
        Call once the weights are final (after loading and any sharding)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def pack_for_cpu(self) -> int:
        """Float32 weights on the CPU: prepack every GEMM's weight for oneDNN (``cpu_linear``;
        the engine does unless told not to), the fused q/k/v and gate/up included; call
        after ``fuse_projections``. Doubles those weights' memory. Returns the GEMMs packed
        (0 on a GPU, in other dtypes, or where torch has no oneDNN)."""
        n = int(cpu_linear.pack(self.lm_head))
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            n += attn.qkv.pack_for_cpu() if attn.qkv is not None else sum(
                cpu_linear.pack(lin) for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
            n += mlp.gate_up.pack_for_cpu() if mlp.gate_up is not None else sum(
                cpu_linear.pack(lin) for lin in (mlp.gate_proj, mlp.up_proj))
            n += cpu_linear.pack(attn.o_proj) + cpu_linear.pack(mlp.down_proj)
        return n

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

class CausalLM(DecoderLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # [V, E]
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # [E] -> [V]
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.tie_weights()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: LayerAttention
    ) -> torch.Tensor:
        """input_ids: [T] int64, positions: [T] int64 (each token's position in its own request)
        -> hidden states [T, E] after the final norm, in the model's dtype."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        x = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary(positions, x.dtype)  # [T, 1, D] each, shared by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)  # [T, E] each
        return self.norm.add_forward(x, residual)[0]  # [T, E]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, E] (rows of forward's output) -> logits [N, V] in float32.

        The matmul runs in the model's dtype and is cast afterwards, as transformers does."""
        return cpu_linear.linear(self.lm_head, hidden).float()  # [N, V]
