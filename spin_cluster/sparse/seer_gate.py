"""The learned gate of ``seer``: its math and its file.

Gate of one layer, per KV head h (SeerAttention-R style; d_g the gate width)::

    q_gate[h]    = mean_g(q[h, g]) @ W_q[h]                   [D] @ [D, d_g]   -> [d_g]
    k_gate[p, h] = [mean_t k[p, t, h] ; max_t k[p, t, h]] @ W_k[h]   [2D] @ [2D, d_g] -> [d_g]
    logit[p, h]  = q_gate[h] . k_gate[p, h] / sqrt(D)

``k_gate`` is what the index stores per page, so Select reads d_g numbers per page instead of
the 2D of a min/max index. A gate is trained offline by self-distillation
(``spin_cluster.profiling.seer_train``, ``spin-cluster profile train-gate``).

Gate file: safetensors with ``w_q`` [L, Hkv, D, d_g], ``w_k`` [L, Hkv, 2D, d_g] and JSON
metadata (the model's identity, page size, d_g, training summary). Loading it for another
model, or another page size, raises ``ValueError`` saying how to get a matching gate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spin_cluster.models.identity import differing_keys, model_identity

FORMAT = "spin-cluster.seer-gate"
VERSION = 1
_META_KEY = "spin_cluster.gate"
_IDENTITY_FIELDS = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "hidden_size", "vocab_size")


# ---- gate math (the algorithm's, and what training fits) ----------------------------------------

def gate_queries(w_q: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """w_q [Hkv, D, d_g]; q [..., H, D] -> [..., Hkv, d_g] (the G query heads mean-pooled)."""
    Hkv, D, _ = w_q.shape
    pooled = q.unflatten(-2, (Hkv, q.shape[-2] // Hkv)).mean(-2)  # [..., Hkv, D]
    return torch.einsum("...hd,hdg->...hg", pooled, w_q)


def gate_keys(w_k: torch.Tensor, mean: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """w_k [Hkv, 2D, d_g]; mean, peak [..., Hkv, D] pooled page keys -> [..., Hkv, d_g]."""
    return torch.einsum("...he,heg->...hg", torch.cat([mean, peak], -1), w_k)


def gate_logits(q_gate: torch.Tensor, k_gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q_gate [B, Hkv, d_g]; k_gate [B, P, Hkv, d_g] -> [B, Hkv, P]."""
    return torch.einsum("bhg,bphg->bhp", q_gate, k_gate) / math.sqrt(head_dim)


# ---- gate file ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gate:
    w_q: torch.Tensor  # [L, Hkv, D, d_g]
    w_k: torch.Tensor  # [L, Hkv, 2D, d_g]
    meta: dict[str, Any]

    @property
    def page_size(self) -> int:
        return int(self.meta["page_size"])


def save_gate(path: str | Path, w_q: torch.Tensor, w_k: torch.Tensor, meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "version": VERSION, **meta}
    tensors = {"w_q": w_q.detach().float().contiguous(), "w_k": w_k.detach().float().contiguous()}
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})


def load_gate(path: str | Path, *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
              model_path: str | Path | None = None) -> Gate:
    """Read a gate file and check it fits this model and page size (the full identity,
    config hash included, when ``model_path`` is given)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"seer gate file {str(path)!r} not found; {_train_hint(model_path)}")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = json.loads((f.metadata() or {}).get(_META_KEY, "null") or "null")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a seer gate file; {_train_hint(model_path)}")
        w_q, w_k = f.get_tensor("w_q"), f.get_tensor("w_k")
    model = meta["model"]
    want = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    if model_path is not None:
        want = model_identity(model_path)
    wrong = (differing_keys(model, want, model_path) if model_path is not None
             else sorted(key for key, value in want.items() if model.get(key) != value))
    if wrong:
        raise ValueError(
            f"seer gate {str(path)!r} was trained for another model ({_describe(model)}; "
            f"differs in {', '.join(wrong)}); {_train_hint(model_path)}"
        )
    if meta["page_size"] != page_size:
        raise ValueError(
            f"seer gate {str(path)!r} pools pages of {meta['page_size']} tokens but cache.page_size="
            f"{page_size}: set cache.page_size={meta['page_size']}, or {_train_hint(model_path, page_size)}"
        )
    return Gate(w_q=w_q, w_k=w_k, meta=meta)


def _describe(model: dict[str, Any]) -> str:
    return ", ".join(f"{key}={model.get(key)}" for key in _IDENTITY_FIELDS)


def _train_hint(model_path: str | Path | None, page_size: int | None = None) -> str:
    model = model_path or "MODEL_FOLDER"
    page = f" --page-size {page_size}" if page_size else ""
    return f"train a gate for this model with `spin-cluster profile train-gate --model {model}{page} --out GATE`"
