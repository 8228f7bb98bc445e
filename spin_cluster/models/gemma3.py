"""The causal LM for Gemma 3 text checkpoints (``Gemma3ForCausalLM``, e.g. Gemma-3-270M).

What differs from the Llama family (``llama.py``), each as transformers' ``modeling_gemma3``:

* RMSNorm scales by ``1 + weight``, in float32 before the cast back (``GemmaRMSNorm``);
* four norms a layer: the attention's and the MLP's outputs are normed before their residual
  add (``post_attention_layernorm``, ``post_feedforward_layernorm``), besides the usual
  pre-norms (``input_layernorm``, ``pre_feedforward_layernorm``);
* per-head q/k norm; GELU-tanh gate; embeddings times sqrt(E), rounded to their dtype;
* per layer, full attention or a sliding window (``config.layer_windows``), and a RoPE base
  for each kind (``rope_theta`` full, ``local_rope_theta`` sliding);
* softmax scale ``query_pre_attn_scalar ** -0.5``, applied by scaling q to the backend's
  ``D ** -0.5``; optional final logit softcapping.

Module names follow the checkpoint's tensor names with the leading ``model.`` dropped.

On CUDA the element-wise work runs as fused Triton launches (``kernels.layer_ops``), four a
layer between the GEMMs and attention: the q/k norms with RoPE and q's scale; the attention's
post-norm, residual add and the MLP's pre-norm; the GELU-tanh gate; the MLP's post-norm,
residual add and the next layer's input norm (the final norm after the last layer). Elsewhere
their torch references run, which round as transformers does.

Shapes (one letter set): T tokens of this step, all requests flattened; N rows to score;
E hidden size; F MLP intermediate size; V vocab size; H query heads; Hkv KV heads; D head dim.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from spin_cluster.kernels import layer_ops
from spin_cluster.models import cpu_linear
from spin_cluster.models.base import LayerAttention
from spin_cluster.models.config import ModelConfig
from spin_cluster.models.layers import MLP, FusedLinears, RotaryEmbedding
from spin_cluster.models.llama import DecoderLM


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, then cast to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim], same dtype
        if layer_ops.fits(x) and x.dim() == 2:
            return layer_ops.gemma_rms_norm(x, self.weight, self.eps)
        return layer_ops.gemma_rms_norm_ref(x, self.weight, self.eps)

    def residual_add(
        self, h: torch.Tensor, x: torch.Tensor, next_norm: GemmaRMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, dim] a sublayer's output, x: [T, dim] the residual stream -> (next_norm(x'),
        x') with x' = x + self(h): this post-norm, the residual add and the norm after it, one
        launch on CUDA. Both norms take this one's eps (a model's norms share one)."""
        if layer_ops.fits(x):
            return layer_ops.gemma_norm_add_norm(h, x, self.weight, next_norm.weight, self.eps)
        return layer_ops.gemma_norm_add_norm_ref(h, x, self.weight, next_norm.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaAttention(nn.Module):
    """Projections, q/k norm and RoPE of one layer; attention itself (with this layer's
    window, if any) is the backend's."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.window = config.layer_windows[layer_id] if config.layer_windows else None
        e, h, hkv, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(e, h * d, bias=bias)  # [E] -> [H*D]
        self.k_proj = nn.Linear(e, hkv * d, bias=bias)  # [E] -> [Hkv*D]
        self.v_proj = nn.Linear(e, hkv * d, bias=bias)  # [E] -> [Hkv*D]
        self.o_proj = nn.Linear(h * d, e, bias=config.o_proj_bias)  # [H*D] -> [E]
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)  # over D, per head
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        # The backend scales scores by D ** -0.5; Gemma by query_pre_attn_scalar ** -0.5.
        # Where they agree (Gemma-3-270M: both 256) q is left untouched, bit for bit.
        scalar = config.query_pre_attn_scalar or d
        self.q_multiplier = None if scalar == d else math.sqrt(d / scalar)
        self.qkv: FusedLinears | None = None

    def fuse(self) -> None:
        self.qkv = FusedLinears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: LayerAttention) -> torch.Tensor:
        # x: [T, E], cos/sin: [T, 1, D] (this layer kind's) -> [T, E]
        t = x.shape[0]
        fused = self.qkv(x) if self.qkv is not None else None
        if fused is None:
            fused = [cpu_linear.linear(proj, x) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        q, k, v = fused
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        # q/k norms, RoPE and q's scale; on CUDA one launch, which also makes a fused GEMM's v
        # view contiguous for the KV writes.
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_multiplier)
        if not layer_ops.fits(q):
            q, k = layer_ops.gemma_qk_norm_rope_ref(q, k, cos, sin, *norms)
        elif v.is_contiguous():
            q, k = layer_ops.gemma_qk_norm_rope(q, k, cos, sin, *norms)
        else:
            q, k, v = layer_ops.gemma_qk_norm_rope(q, k, cos, sin, *norms, v=v)
        if self.window is None:
            o = attn.forward(self.layer_id, q, k, v)  # [T, H, D]
        else:
            o = attn.forward(self.layer_id, q, k, v, window=self.window)
        return cpu_linear.linear(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))  # [T, E]


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))), with each
    residual add fused between the post-norm before it and the norm after it."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        e, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(e, eps)
        self.self_attn = GemmaAttention(config, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(e, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(e, eps)
        self.mlp = MLP(config)  # the GELU-tanh gate (config.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(e, eps)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: LayerAttention,
        next_norm: GemmaRMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, E] the residual stream, h: [T, E] its input norm (formed by the layer before,
        or by the model for the first) -> (the stream after this layer, ``next_norm`` of it:
        the next layer's input norm, or the model's final norm)."""
        a = self.self_attn(h, cos, sin, attn)  # [T, E]
        h, x = self.post_attention_layernorm.residual_add(a, x, self.pre_feedforward_layernorm)
        m = self.mlp(h)  # [T, E]
        h, x = self.post_feedforward_layernorm.residual_add(m, x, next_norm)
        return x, h


class Gemma3CausalLM(DecoderLM):
    """Same interface as ``CausalLM``: forward(input_ids, positions, attn) -> [T, E] hidden,
    compute_logits(hidden) -> [N, V] float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # [V, E]
        self.embed_scale = config.hidden_size**0.5  # rounded to the embeddings' dtype when applied
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # [E] -> [V]
        self.rotary = RotaryEmbedding(config)  # full-attention layers
        local = dataclasses.replace(config, rope_theta=config.local_rope_theta or config.rope_theta)
        self.local_rotary = RotaryEmbedding(local)  # sliding-window layers
        if config.tie_word_embeddings:
            self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: LayerAttention) -> torch.Tensor:
        """input_ids: [T] int64, positions: [T] int64 -> hidden states [T, E] after the final norm."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        x = self.embed_tokens(input_ids)  # [T, E]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        full = self.rotary(positions, x.dtype)  # (cos, sin): [T, 1, D] each
        local = self.local_rotary(positions, x.dtype)
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        h = norms[0](x)  # [T, E]
        for layer, next_norm in zip(self.layers, norms[1:]):
            cos, sin = full if layer.self_attn.window is None else local
            x, h = layer(x, h, cos, sin, attn, next_norm)  # [T, E] each
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, E] -> logits [N, V] in float32 (softcapped where the config says)."""
        logits = cpu_linear.linear(self.lm_head, hidden)  # [N, V]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
