"""Training the gate of ``seer`` by self-distillation (``spin-cluster profile train-gate``).

Run the dense model over calibration text (Python standard-library docs from ``pydoc``), and
for sampled query positions at page ends take the true attention mass per page (softmax over
every earlier key, summed over the page and the G query heads). Pages the system always takes
(the first and the query's own) are left out and the rest renormalised; the gate
(``spin_cluster.sparse.seer_gate``) learns, with Adam, to match that distribution:
KL(target || softmax(logit)). W_q starts as an orthonormal projection U [D, d_g] and W_k as
[U; 0], i.e. a projected ``q . mean key`` before any training.
"""

from __future__ import annotations

import argparse
import math
import pydoc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spin_cluster.models.identity import model_identity
from spin_cluster.sparse.seer_gate import save_gate

# Standard-library modules whose pydoc text is the default calibration corpus (offline, fixed).
CALIBRATION_MODULES = ("json", "functools", "itertools", "collections", "textwrap", "pathlib",
                       "argparse", "heapq", "bisect", "statistics", "string", "fractions")


def initial_weights(num_layers: int, num_kv_heads: int, head_dim: int, gate_dim: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q [L, Hkv, D, d_g], w_k [L, Hkv, 2D, d_g]): q . mean key through one random projection."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_layers, num_kv_heads, head_dim, max(head_dim, gate_dim), generator=g)
    u = torch.linalg.qr(a).Q[..., :gate_dim]  # [L, Hkv, D, d_g] orthonormal columns (d_g <= D)
    if gate_dim > head_dim:
        u = torch.cat([u, torch.zeros(*u.shape[:-1], gate_dim - u.shape[-1])], -1)
    return u.clone(), torch.cat([u, torch.zeros_like(u)], -2)


# ---- calibration data ---------------------------------------------------------------------------

def calibration_texts(modules: tuple[str, ...] = CALIBRATION_MODULES) -> list[str]:
    """Plain-text pydoc pages of standard-library modules: offline and the same everywhere."""
    import importlib

    return [pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext) for name in modules]


@dataclass(frozen=True)
class _Targets:
    """Per layer, for one token sequence of P pages and N sampled queries."""

    q_pool: torch.Tensor  # [L, N, Hkv, D] mean-pooled queries
    k_mean: torch.Tensor  # [L, P, Hkv, D]
    k_max: torch.Tensor  # [L, P, Hkv, D]
    mass: torch.Tensor  # [L, N, Hkv, P] true attention mass of the candidate pages, sums to 1
    candidate: torch.Tensor  # [N, P] pages the gate is trained to rank


class _Recorder:
    """LayerAttention for one whole sequence: causal attention, and at the sampled query
    positions the attention mass each page receives."""

    def __init__(self, query_positions: torch.Tensor, page_size: int) -> None:
        self.query_positions = query_positions  # [N]
        self.page_size = page_size
        self.q_pool: list[torch.Tensor] = []
        self.k_mean: list[torch.Tensor] = []
        self.k_max: list[torch.Tensor] = []
        self.mass: list[torch.Tensor] = []

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        T, H, D = q.shape
        Hkv, S = k.shape[1], self.page_size
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        qs = q[self.query_positions].float()  # [N, H, D]
        kg = k.float().repeat_interleave(H // Hkv, dim=1)  # [T, H, D]
        logits = torch.einsum("nhd,thd->nht", qs, kg) / math.sqrt(D)
        causal = torch.arange(T)[None, :] <= self.query_positions[:, None]  # [N, T]
        probs = logits.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1)  # [N, H, T]
        P = T // S
        per_page = probs[..., : P * S].unflatten(-1, (P, S)).sum(-1)  # [N, H, P]
        self.mass.append(per_page.unflatten(1, (Hkv, H // Hkv)).sum(2))  # [N, Hkv, P]
        self.q_pool.append(qs.unflatten(1, (Hkv, H // Hkv)).mean(2))  # [N, Hkv, D]
        pages = k[: P * S].float().unflatten(0, (P, S))  # [P, S, Hkv, D]
        self.k_mean.append(pages.mean(1))
        self.k_max.append(pages.amax(1))
        return out[0].transpose(0, 1).to(q.dtype)


def _collect(model, token_ids: list[int], page_size: int, num_queries: int,
             generator: torch.Generator) -> _Targets:
    T, S = len(token_ids), page_size
    P = T // S
    # Queries at page ends: every page before them is complete, as for a middle page at decode.
    first = 3  # at least one page that is neither the first nor the query's own
    ends = torch.arange(first, P) * S + S - 1
    pick = torch.randperm(len(ends), generator=generator)[:num_queries].sort().values
    positions = ends[pick]  # [N]
    rec = _Recorder(positions, S)
    with torch.no_grad():
        model(torch.tensor(token_ids), torch.arange(T), rec)
    page = torch.arange(P)
    own = positions // S  # [N]
    candidate = (page[None, :] >= 1) & (page[None, :] < own[:, None])  # [N, P]
    mass = torch.stack(rec.mass) * candidate[None, :, None, :]  # [L, N, Hkv, P]
    mass = mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)
    return _Targets(torch.stack(rec.q_pool), torch.stack(rec.k_mean), torch.stack(rec.k_max), mass, candidate)


# ---- training -----------------------------------------------------------------------------------

def _kl(w_q: torch.Tensor, w_k: torch.Tensor, data: list[_Targets], head_dim: int) -> torch.Tensor:
    """Mean KL(true page mass || softmax(gate logits)) over layers, sequences, queries, heads."""
    losses = []
    for t in data:
        q_gate = torch.einsum("lnhd,lhdg->lnhg", t.q_pool, w_q)  # [L, N, Hkv, d_g]
        k_gate = torch.einsum("lphe,lheg->lphg", torch.cat([t.k_mean, t.k_max], -1), w_k)  # [L, P, Hkv, d_g]
        logits = torch.einsum("lnhg,lphg->lnhp", q_gate, k_gate) / math.sqrt(head_dim)
        logits = logits.masked_fill(~t.candidate[None, :, None, :], float("-inf"))
        log_p = logits.log_softmax(-1).masked_fill(~t.candidate[None, :, None, :], 0.0)
        kl = (t.mass * (t.mass.clamp(min=1e-30).log() - log_p)).sum(-1)  # [L, N, Hkv]
        losses.append(kl.mean())
    return torch.stack(losses).mean()


def train_gate(model_path: str | Path, out_path: str | Path, texts: list[str] | None = None,
               steps: int = 300, *, page_size: int = 16, gate_dim: int = 32, seq_len: int = 1024,
               num_seqs: int = 12, queries_per_seq: int = 64, lr: float = 1e-2, seed: int = 0,
               progress: bool = False) -> dict[str, Any]:
    """Train a gate for the model in ``model_path`` on ``texts`` (default: ``calibration_texts()``)
    and write it to ``out_path``. Runs on the CPU in float32. With two or more sequences the last
    one is held out to measure generalisation. Returns the training summary."""
    from spin_cluster.models import load_model
    from spin_cluster.tokenizer import Tokenizer

    for name, value, low in (("steps", steps, 0), ("page_size", page_size, 1), ("gate_dim", gate_dim, 1),
                             ("num_seqs", num_seqs, 1), ("queries_per_seq", queries_per_seq, 1)):
        if value < low:
            raise ValueError(f"train-gate {name}={value}: must be >= {low}")
    if seq_len < 4 * page_size:
        raise ValueError(f"train-gate seq_len={seq_len}: must be >= 4 pages ({4 * page_size} tokens)")
    identity = model_identity(model_path)
    model = load_model(model_path, torch.float32, "cpu", progress=progress)
    text = "\n\n".join(texts if texts is not None else calibration_texts())
    seqs = _sequences(Tokenizer(model_path).encode(text), seq_len, num_seqs, model.config.bos_token_id)
    g = torch.Generator().manual_seed(seed)
    data = [_collect(model, s, page_size, queries_per_seq, g) for s in seqs]
    train, held = (data[:-1], data[-1:]) if len(data) > 1 else (data, [])
    mc = model.config
    w_q, w_k = initial_weights(mc.num_layers, mc.num_kv_heads, mc.head_dim, gate_dim, seed)
    summary = {"steps": steps, "sequences": len(train), "held_out_sequences": len(held), "seq_len": seq_len,
               "queries_per_seq": queries_per_seq, "lr": lr, "seed": seed,
               **_fit(w_q, w_k, train, held, steps, lr, mc.head_dim)}
    save_gate(out_path, w_q, w_k, {"model": identity, "page_size": page_size, "gate_dim": gate_dim,
                                   "key_pooling": "mean+max", "query_pooling": "mean", "training": summary})
    return summary


def _sequences(stream: list[int], seq_len: int, num_seqs: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of the token stream, each starting with BOS like a prompt."""
    seqs = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)][:num_seqs]
    if not seqs:
        raise ValueError(f"train-gate: the calibration text has {len(stream)} tokens, fewer than seq_len={seq_len}")
    return [s if i == 0 or bos is None else [bos, *s[1:]] for i, s in enumerate(seqs)]


def _fit(w_q: torch.Tensor, w_k: torch.Tensor, train: list[_Targets], held: list[_Targets], steps: int,
         lr: float, head_dim: int) -> dict[str, float]:
    """Adam on the KL, in place on w_q / w_k; returns the KL before and after."""
    out: dict[str, float] = {}

    def measure(when: str) -> None:
        with torch.no_grad():
            out[f"kl_{when}"] = _kl(w_q, w_k, train, head_dim).item()
            if held:
                out[f"kl_held_out_{when}"] = _kl(w_q, w_k, held, head_dim).item()

    measure("initial")
    w_q.requires_grad_(True)
    w_k.requires_grad_(True)
    opt = torch.optim.Adam([w_q, w_k], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        _kl(w_q, w_k, train, head_dim).backward()
        opt.step()
    measure("final")
    w_q.requires_grad_(False)
    w_k.requires_grad_(False)
    return out


# ---- command line -------------------------------------------------------------------------------

def add_train_gate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``profile train-gate`` on the top-level subparsers (creating ``profile`` if needed)."""
    profile = subparsers.choices.get("profile") or subparsers.add_parser("profile", help="offline profiling")
    actions = [a for a in profile._actions if isinstance(a, argparse._SubParsersAction)]
    group = actions[0] if actions else profile.add_subparsers(metavar="ACTION")
    p = group.add_parser("train-gate", help="train the seer gate of a model by self-distillation")
    p.add_argument("--model", default=None, help="model folder (default: the prepared default model)")
    p.add_argument("--out", required=True, help="gate file to write (.safetensors)")
    p.add_argument("--steps", type=int, default=300, help="Adam steps (default 300)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page; must equal cache.page_size")
    p.add_argument("--gate-dim", type=int, default=32, help="gate width d_g (default 32)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per calibration sequence")
    p.add_argument("--num-seqs", type=int, default=12, help="calibration sequences (the last is held out)")
    p.add_argument("--queries-per-seq", type=int, default=64, help="sampled query positions per sequence")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train_gate)
    return p


def _cmd_train_gate(args: argparse.Namespace) -> int:
    from spin_cluster.model_store import prepare_default_model

    model = args.model or str(prepare_default_model())
    summary = train_gate(model, args.out, steps=args.steps, page_size=args.page_size, gate_dim=args.gate_dim,
                         seq_len=args.seq_len, num_seqs=args.num_seqs, queries_per_seq=args.queries_per_seq,
                         lr=args.lr, seed=args.seed, progress=True)
    held = (f", held out {summary['kl_held_out_initial']:.4f} -> {summary['kl_held_out_final']:.4f}"
            if "kl_held_out_final" in summary else "")
    print(f"{args.out}: KL {summary['kl_initial']:.4f} -> {summary['kl_final']:.4f}{held} after {args.steps} steps")
    return 0
