"""Building blocks of a Llama-family decoder, written to match transformers' numerics.

Every op is per token: inputs are ``[T, ...]`` with all requests' tokens flattened into T and
no batch dimension. The only cross-token op, attention, is delegated to an ``LayerAttention``.

Shapes (one letter set): T tokens, E hidden size, F MLP intermediate size, H query heads,
Hkv KV heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from spin_cluster.kernels import cpu_native, layer_ops
from spin_cluster.models import cpu_linear
from spin_cluster.models.base import LayerAttention
from spin_cluster.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 (as transformers' LlamaRMSNorm:
    normalize in float32, cast back to the input dtype, then scale by the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim], same dtype. One fused op on CUDA instead of five.
        normed = nn.functional.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, dim] -> (norm(x + residual), x + residual); residual None: (norm(x), x).
        One Triton launch on CUDA (the add, the norm and the scale), one native call on a
        float32 CPU (``cpu_native``), torch elsewhere."""
        if layer_ops.fits(x, self.weight) and x.dim() == 2:
            return layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2 and cpu_native.fits(x, self.weight, *(() if residual is None else (residual,))):
            return cpu_native.add_rms_norm(x, residual, self.weight, self.eps)
        return layer_ops.add_rms_norm_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, on CPU; llama3 and yarn scaling as transformers'
    ``_compute_llama3_parameters`` and ``_compute_yarn_parameters``."""
    dim = config.head_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    pos_freqs = base**exponents  # [D/2]
    inv_freq = 1.0 / pos_freqs
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(scaling, pos_freqs, base)
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported RoPE type {scaling['rope_type']!r}")

    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq  # [D/2]
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    )
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)  # [D/2]


def _yarn_inv_freq(scaling: dict, pos_freqs: torch.Tensor, base: float) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the dimensions that turn fewer than ``beta_slow`` times over
    the original context are interpolated (divided by ``factor``), those that turn more than
    ``beta_fast`` times kept, and a linear ramp blends the band between them.

        dim index i:  0 ........ low ====ramp==== high ........ D/2
                      kept (extrapolated)              interpolated
    """
    context, dim = scaling["original_max_position_embeddings"], 2 * pos_freqs.shape[0]

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    # On the CPU explicitly: the model is built under the meta device.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [D/2]
    kept = 1 - ramp
    return (1.0 / (scaling["factor"] * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept  # [D/2]


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, else 1."""
    scaling = config.rope_scaling
    return scaling["attention_factor"] if scaling is not None and scaling["rope_type"] == "yarn" else 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of this step, computed in float32 on the fly, once per
    step for every layer.

    ``inv_freq`` is a plain attribute rather than a buffer so that ``model.to(bfloat16)`` never
    rounds it; it follows the positions' device.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config)  # [D/2] float32
        self.attention_factor = rope_attention_factor(config)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int -> (cos, signed sin): [T, 1, D] each in ``dtype``, as
        ``apply_rope`` takes them. The sign of rotate_half's first half is folded into sin."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].to(torch.float32) * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, D]
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[..., :half].neg_()
        cos = emb.cos()
        if self.attention_factor != 1.0:  # YaRN scales q.k by factor^2 through both rotations
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, signed sin: [T, 1, D] from ``RotaryEmbedding`` -> [T, heads, D].

    rotate_half(x) * sin, with rotate_half(x) = (-x2, x1), equals roll(x, D/2) * (-s1, s2):
    one roll instead of two slices, a negation and a concatenation, and the same values
    (a sign flip is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class FusedLinears:
    """Several ``nn.Linear`` of one input fused into one GEMM: their weights are concatenated
    by rows into one tensor, and each Linear's weight (and bias) becomes a view of it, so
    memory is not doubled and the checkpoint's module names stay. At decode's small batches
    a GEMM is bound by reading its weights and, on the GPU, by its launches: q/k/v as one
    GEMM and gate/up as one save three of seven GEMMs (and their split-K reductions) per layer.

    ``__call__`` returns None once any member's weight was replaced or moved (sharding keeps
    rows; ``.to()`` moves): the caller then runs the members one by one, never a stale fusion."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
            self.bias = (torch.cat([lin.bias.detach() for lin in linears])
                         if all(lin.bias is not None for lin in linears) else None)
        if self.bias is None and any(lin.bias is not None for lin in linears):
            raise ValueError("fused linears must all have a bias or none")
        start = 0
        for lin, n in zip(linears, self.sizes):
            lin.weight = nn.Parameter(self.weight[start : start + n], requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start : start + n], requires_grad=False)
            start += n
        self._members = [(lin, lin.weight, lin.bias, lin.weight.data_ptr()) for lin in linears]
        self.cpu_pack: cpu_linear.PackedLinear | None = None

    def current(self) -> bool:
        """Whether every member still holds its view of the fused weight (not replaced, not moved)."""
        return all(lin.weight is w and lin.bias is b and w.data_ptr() == ptr for lin, w, b, ptr in self._members)

    def pack_for_cpu(self) -> bool:
        """Prepack the fused weight for oneDNN (``cpu_linear``; float32 CPU weights only)."""
        self.cpu_pack = cpu_linear.pack_weight(self.weight, self.bias)
        return self.cpu_pack is not None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """x: [T, in] -> one [T, out_i] view per member, or None if the fusion is stale."""
        if not self.current():
            return None
        if cpu_linear.serves(self.cpu_pack, x, self.weight, self.bias):
            y = self.cpu_pack(x)
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        return list(y.split(self.sizes, dim=-1))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (Llama, Qwen) or GELU-tanh (Gemma 3),
    as ``config.hidden_act`` says."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"
        e, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(e, f, bias=bias)  # [E] -> [F]
        self.up_proj = nn.Linear(e, f, bias=bias)  # [E] -> [F]
        self.down_proj = nn.Linear(f, e, bias=bias)  # [F] -> [E]
        self.gate_up: FusedLinears | None = None

    def fuse(self) -> None:
        """gate and up as one GEMM (``FusedLinears``); call after loading (and sharding)."""
        self.gate_up = FusedLinears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, E] -> [T, E]
        fused = self.gate_up(x) if self.gate_up is not None else None
        if fused is None:
            fused = (cpu_linear.linear(self.gate_proj, x), cpu_linear.linear(self.up_proj, x))
        gate, up = fused  # [T, F] each
        if self.gelu_tanh:  # one launch on CUDA
            h = layer_ops.gelu_tanh_mul(gate, up) if layer_ops.fits(gate) else layer_ops.gelu_tanh_mul_ref(gate, up)
        elif layer_ops.fits(gate):
            h = layer_ops.silu_mul(gate, up)
        elif cpu_native.fits(gate, up):
            h = cpu_native.silu_mul(gate, up)
        else:
            h = nn.functional.silu(gate) * up
        return cpu_linear.linear(self.down_proj, h)  # [T, E]


class Attention(nn.Module):
    """Projections, optional per-head q/k norm and RoPE of one layer; attention itself is the
    backend's. Head h of q is rows [h*D, (h+1)*D) of q_proj.weight (likewise k/v with Hkv heads),
    and o_proj's input columns follow the same per-head layout."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads  # H
        self.num_kv_heads = config.num_kv_heads  # Hkv
        self.head_dim = config.head_dim  # D
        e, h, hkv, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(e, h * d, bias=config.attention_bias)  # [E] -> [H*D]
        self.k_proj = nn.Linear(e, hkv * d, bias=config.attention_bias)  # [E] -> [Hkv*D]
        self.v_proj = nn.Linear(e, hkv * d, bias=config.attention_bias)  # [E] -> [Hkv*D]
        self.o_proj = nn.Linear(h * d, e, bias=config.o_proj_bias)  # [H*D] -> [E]
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(d, config.rms_norm_eps)  # over D, per head
            self.k_norm: RMSNorm | None = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FusedLinears | None = None

    def fuse(self) -> None:
        """q, k and v as one GEMM (``FusedLinears``); call after loading (and sharding)."""
        self.qkv = FusedLinears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: LayerAttention
    ) -> torch.Tensor:
        # x: [T, E], cos/sin: [T, 1, D] -> [T, E]
        t = x.shape[0]
        fused = self.qkv(x) if self.qkv is not None else None
        if fused is None:
            fused = [cpu_linear.linear(proj, x) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        q, k, v = fused
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)  # [T, H, D]
            k = self.k_norm(k)  # [T, Hkv, D]
        if layer_ops.fits(q):  # q and k in one launch (and v made contiguous by it, if fused)
            if v.is_contiguous():
                q, k = layer_ops.rope_qk(q, k, cos, sin)
            else:
                q, k, v = layer_ops.rope_qk(q, k, cos, sin, v)
        elif cpu_native.fits(q, k, v, cos, sin):  # the same, one native call on the CPU
            q, k, v = cpu_native.rope_qkv(q, k, cos, sin, v)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [T, H, D], [T, Hkv, D]
        o = attn.forward(self.layer_id, q, k, v)  # [T, H, D]
        return cpu_linear.linear(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))  # [T, E]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)), with each residual
    add fused into the norm that follows it."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attn: LayerAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, E] the previous block's output (the embeddings for the first layer),
        residual: [T, E] the stream before it (None for the first layer) -> (this layer's MLP
        output, the stream before it). The residual adds are fused into the next norm: the
        stream after this layer is the sum of the two, which the next layer's (or the
        model's final) norm forms."""
        h, residual = self.input_layernorm.add_forward(x, residual)  # residual = x + residual
        h = self.self_attn(h, cos, sin, attn)  # [T, E]
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
