"""The bytes a decode step must move, and the time they take at HBM and PCIe speed: the lower
bound each ``benchmarks/e2e.py`` step is reported against (its batch-1 roofline and each
mode's step at its decode batch)."""

from __future__ import annotations

import time


def hbm_bandwidth_bytes_s() -> float | None:
    """Device copy bandwidth (read + write) of a 2 GiB bf16 copy, best of 5."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * 2**31 / best


def decode_weight_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter once, but the embedding table (a
    step reads only its tokens' rows) unless it is tied to the LM head."""
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if not model.config.tie_word_embeddings:
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return weight_bytes


def kv_layer_bytes(model) -> int:
    """K and V bytes of one token in one layer."""
    mc = model.config
    return 2 * mc.num_kv_heads * mc.head_dim * model.embed_tokens.weight.element_size()


def full_layers(model) -> int:
    """Layers that attend over the whole context (those without a sliding window)."""
    layers = model.config.full_attention_layers()
    return model.config.num_layers if layers is None else len(layers)


def window_kv_bytes(model, context: int) -> int:
    """K and V bytes one request's sliding-window layers read at ``context`` tokens: each
    layer's last ``window`` tokens (Gemma 3's five in six; none for other models)."""
    return kv_layer_bytes(model) * sum(min(context, w) for w in model.config.layer_windows if w is not None)


def roofline(engine, context: int, step_s: float | None, bandwidth: float | None) -> dict:
    """Batch-1 decode reads every weight but the embedding table once and the KV of
    ``context`` tokens: that many bytes over the HBM bandwidth is the step's lower bound."""
    model = engine.model
    weight_bytes = decode_weight_bytes(model)
    kv_bytes = context * full_layers(model) * kv_layer_bytes(model) + window_kv_bytes(model, context)
    bound_s = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
    return {"context": context, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "hbm_bytes_s": bandwidth,
            "bound_step_s": bound_s, "measured_step_s": step_s,
            "fraction_of_roofline": bound_s / step_s if bound_s and step_s else None}


# PCIe host -> device bandwidth of the gather that Retrieve runs (measured on the H200 here,
# shared/ARCHITECTURE.md: 50.5-51.2 GB/s zero-copy gather, 55 GB/s contiguous copy).
PCIE_BYTES_S = 55e9


def step_roofline(engine, r: dict, context: int, bandwidth: float | None) -> dict | None:
    """The bytes a decode step of this mode must move at its decode batch B and ``context``
    tokens per request, and the time they take (HBM at ``bandwidth``, misses and
    dense-offload's KV over PCIe at ``PCIE_BYTES_S``), against the measured step:

        dense            weights + B x every token's K and V
        dense-offload    weights; B x every token's K and V over PCIe
        sparse modes     weights + B x (Select's index + the attended pages' K and V);
                         the measured misses per decode step over PCIe
    and, in every mode, B x the sliding-window layers' windows (a model with them).
    """
    if not bandwidth or not r.get("decode_tok_s") or not r.get("peak_decode_batch"):
        return None
    model = engine.model
    weight_bytes = decode_weight_bytes(model)
    B = r["peak_decode_batch"]
    per_token_kv = full_layers(model) * kv_layer_bytes(model)  # the full-attention layers'
    attn = engine.runner.attention
    attn = getattr(attn, "spin", attn)  # a hybrid cache: its full-attention layers' backend
    kv = engine.kv
    # Sliding-window layers read their window on the GPU in every mode.
    hbm, pcie = weight_bytes + B * window_kv_bytes(model, context), 0.0
    if kv.buffer is None:  # GPU-only pages
        hbm += B * context * per_token_kv
    elif attn.algorithm.selects_all:
        pcie += B * context * per_token_kv
    else:
        S = kv.page_size
        attended = attn.budget.mean_attended_pages(context) * S  # sink + own budget + local, mean over heads
        hbm += B * (context * attn.algorithm.index_bytes_per_token() + attended * per_token_kv)
        steps = r.get("decode_steps") or 0
        if steps:
            pcie += r["buffer_misses_total"] / steps * kv.buffer.page_bytes
    bound_s = hbm / bandwidth + pcie / PCIE_BYTES_S
    step_s = B / r["decode_tok_s"]
    return {"batch": B, "context": context, "hbm_bytes": hbm, "pcie_bytes": pcie, "bound_step_s": bound_s,
            "measured_step_s": step_s, "x_roofline": step_s / bound_s}
