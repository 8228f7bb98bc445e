"""How far each method's attention output is from dense, on the model's real activations.

One dense forward of a prompt captures, per layer, the last position's query and every
key and value. Treating that position as a decode step over the whole prompt, each method
selects pages the way the engine's Select does (the algorithm's ``on_append`` over the
prompt's keys, its ``score`` for the query, ``select_pages`` with the engine's sink /
budget / local rule), and attention restricted to those pages is compared with dense:

    rel_l2_error      ||o_sparse - o_dense|| / ||o_dense||, per (layer, query head)
    attention_recall  share of the dense softmax mass on the selected tokens

both averaged over layers, heads and prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spin_cluster.config import SparseConfig
from spin_cluster.sparse import SelectPlan, get_algorithm, select_pages
from spin_cluster.sparse.budget import PageBudget, floor_tokens
from spin_cluster.profiling.methods import Method


@dataclass(frozen=True)
class FidelityRow:
    method: str  # Method.label
    length: int  # the context length the prompts were made for
    num_prompts: int
    rel_l2_error: float  # mean over prompts, layers and query heads
    attention_recall: float  # 0..1, same mean


@dataclass(frozen=True)
class LayerCapture:
    q: torch.Tensor  # [H, D] the last position's query, float32
    k: torch.Tensor  # [T, Hkv, D] float32
    v: torch.Tensor  # [T, Hkv, D] float32


class CapturingAttention:
    """LayerAttention for one whole prompt in one forward: causal SDPA, and a copy of each
    layer's last query and all keys and values."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerCapture] = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]
        self.layers[layer_id] = LayerCapture(q[-1].float(), k.float(), v.float())
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True,
        )  # [1, H, T, D]
        return o[0].transpose(0, 1)


@torch.inference_mode()
def capture(model: torch.nn.Module, prompt_ids: Sequence[int]) -> list[LayerCapture]:
    """One dense forward of ``prompt_ids``; returns the captures in layer order."""
    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)  # [T]
    backend = CapturingAttention()
    model(ids, torch.arange(len(ids), device=device), backend)
    return [backend.layers[i] for i in sorted(backend.layers)]


def selected_tokens(method: Method, sparse: SparseConfig, layers: list[LayerCapture], page_size: int) -> torch.Tensor:
    """[L, Hkv, T] bool: the tokens each (layer, KV head) attends to at a decode step over the
    captured prompt, chosen as the engine chooses them (``SpinAttention.begin_step``)."""
    T, Hkv, D = layers[0].k.shape
    L, S = len(layers), page_size
    device = layers[0].k.device
    num_pages = -(-T // S)
    cls = get_algorithm(method.algorithm)
    algorithm = cls(num_layers=L, num_kv_heads=Hkv, head_dim=D, page_size=S, max_seqs=1,
                    max_pages_per_seq=num_pages, device=device)
    page_budget = PageBudget(sparse, S, Hkv)
    budget = num_pages if cls.selects_all else page_budget.budget_pages(T)
    floor = floor_tokens(sparse)
    plan = SelectPlan(
        num_pages=torch.tensor([num_pages], device=device),
        tail_len=torch.tensor([(T - 1) % S + 1], dtype=torch.int32, device=device),
        sink_pages=page_budget.sink_pages,
        local_pages=page_budget.local_pages,
        budget_pages=torch.full((1, Hkv), budget, dtype=torch.long, device=device),
        max_pages=num_pages,
        max_budget=budget,
        dense_rows=torch.tensor([T <= floor], device=device) if floor else None,
    )
    rows = torch.zeros(1, dtype=torch.long, device=device)
    token_page = torch.arange(T, device=device) // S  # [T]
    masks = []
    for layer, cap in enumerate(layers):
        algorithm.on_append(layer, rows.expand(T), torch.arange(T, device=device), cap.k)
        scores = None if cls.selects_all else algorithm.score(layer, cap.q[None], rows, num_pages)
        want, _ = select_pages(scores, cls.selects_all, plan, Hkv)  # [1, Hkv, K], -1 padded
        page_on = torch.zeros(Hkv, num_pages + 1, dtype=torch.bool, device=device)
        page_on.scatter_(1, torch.where(want[0] >= 0, want[0], num_pages), True)
        masks.append(page_on[:, token_page])  # [Hkv, T]
    return torch.stack(masks)


def compare(layers: list[LayerCapture], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rel_l2_error [L, H], attention_recall [L, H]) of attending to ``mask`` [L, Hkv, T]."""
    errors, recalls = [], []
    for cap, keep in zip(layers, mask):
        H, D = cap.q.shape
        G = H // cap.k.shape[1]
        scores = torch.einsum("hd,thd->ht", cap.q, cap.k.repeat_interleave(G, dim=1)) * D**-0.5  # [H, T]
        v = cap.v.repeat_interleave(G, dim=1)  # [T, H, D]
        dense = scores.softmax(-1)
        sparse = scores.masked_fill(~keep.repeat_interleave(G, dim=0), float("-inf")).softmax(-1)
        o_dense = torch.einsum("ht,thd->hd", dense, v)
        o_sparse = torch.einsum("ht,thd->hd", sparse, v)
        errors.append((o_sparse - o_dense).norm(dim=-1) / o_dense.norm(dim=-1).clamp(min=1e-12))
        recalls.append((dense * keep.repeat_interleave(G, dim=0)).sum(-1))
    return torch.stack(errors), torch.stack(recalls)


def attention_fidelity(model: torch.nn.Module, prompts: Iterable[tuple[int, Sequence[int]]], methods: Sequence[Method],
                       *, sink_tokens: int, local_tokens: int, page_size: int,
                       floor_tokens: int | None = 0) -> list[FidelityRow]:
    """``prompts``: (context length, prompt ids). One row per (method, length); ``floor_tokens``:
    the methods' budget floor (0: off; None: sparse.budget_floor_tokens' default)."""
    sums: dict[tuple[str, int], list[float]] = {}
    for length, ids in prompts:
        layers = capture(model, ids)
        for method in methods:
            opts = method.sparse_options(length, sink_tokens, local_tokens, floor_tokens)
            sparse = SparseConfig(**opts)
            err, rec = compare(layers, selected_tokens(method, sparse, layers, page_size))
            acc = sums.setdefault((method.label, length), [0.0, 0.0, 0])
            acc[0] += err.mean().item()
            acc[1] += rec.mean().item()
            acc[2] += 1
    return [FidelityRow(label, length, int(n), e / n, r / n) for (label, length), (e, r, n) in sums.items()]


def measure(config, *, progress: bool = True) -> list[FidelityRow]:
    """Fidelity of ``config``'s methods (an ``evaluate.EvalConfig``) on one prompt per task
    and length (its first seed), with the model loaded as the engine loads it."""
    import dataclasses

    from tqdm.auto import tqdm

    from spin_cluster.engine.device import resolve_device, resolve_dtype
    from spin_cluster.models import load_model
    from spin_cluster.profiling.evaluate import build_samples
    from spin_cluster.tokenizer import Tokenizer

    path, base = config.resolved_model_path(), config.base
    device = resolve_device(base.model.device)
    model = load_model(path, dtype=resolve_dtype(base.model.dtype, device), device=device, progress=False,
                       overrides=base.model.hf_overrides).eval()
    work = build_samples(dataclasses.replace(config, samples_per_task=1), Tokenizer(path))
    prompts = tqdm([(n, s.prompt_ids) for n, s in work], desc="fidelity", unit="prompt", disable=not progress)
    return attention_fidelity(model, prompts, config.methods(), sink_tokens=base.sparse.sink_tokens,
                              local_tokens=base.sparse.local_tokens, page_size=base.cache.page_size,
                              floor_tokens=base.sparse.budget_floor_tokens)
