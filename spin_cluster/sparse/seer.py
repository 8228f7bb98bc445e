"""seer: a learned gate scores pages (SeerAttention-R style; the gate is in ``seer_gate``).

Per page the index keeps the gate's key, ``[mean_t k_t ; max_t k_t] @ W_k`` (d_g numbers), and
a query scores pages by ``(mean_g q_g) @ W_q . k_gate / sqrt(D)``: Select reads d_g numbers per
page (Quest reads 2D).

Pooling needs a page's keys together, but they arrive over several calls (a prefill chunk may
end mid-page; decode adds one token a call). So each call reduces its tokens by run (the
consecutive tokens of one (request, page)), merges a run that continues a page with that row's
open-page accumulators (sum and max of the keys so far), projects every run to its gate key,
and keeps each row's last run as the new open page::

    tokens   r0 r0 r0 | r0 r0 | r1 | r2 r2 r2 r2 | r2      rows, in call order
    pages    p7 p7 p7 | p8 p8 | p3 | p0 p0 p0 p0 | p1      positions // S
    runs     0        | 1     | 2  | 3           | 4       cumsum of (row, page) changes
    open     .          r0      r1                 r2      last run per row -> open_sum/open_max

This relies on the engine's layout of a step: each request's tokens are consecutive and in
position order (one decode token or one prefill chunk per request).

Deviations from SeerAttention-R: the gate sees post-RoPE q and k (what ``on_append`` and
``score`` receive; SeerAttention-R projects pre-RoPE q/k and applies RoPE inside the gate),
the G query heads are mean-pooled before W_q (as its "Qavgproj" option), keys are pooled by
mean and max (it also uses min), and the page is the block.

The gate file comes from the ``gate_path`` argument, else the ``SPIN_SEER_GATE`` environment
variable. With ``model_path`` the file's full model identity (config hash included) is
checked; without it, layers, KV heads, head dim and page size.

Index layout, per layer: ``keys`` [R * P + 1, Hkv, d_g] (the extra last row absorbs masked-off
writes); ``open_sum`` / ``open_max`` [R + 1, Hkv, D] the open page of each row.
"""

from __future__ import annotations

import os

import torch

from spin_cluster.sparse.contract import SparseAlgorithm, register
from spin_cluster.sparse.seer_gate import gate_keys, gate_logits, gate_queries, load_gate

GATE_ENV = "SPIN_SEER_GATE"


def gate_path_from_env() -> str | None:
    """SPIN_SEER_GATE: the seer gate file when the constructor is given none."""
    return os.environ.get(GATE_ENV) or None


@register
class Seer(SparseAlgorithm):
    name = "seer"

    def __init__(self, *, gate_path: str | None = None, model_path: str | None = None, **kw) -> None:
        super().__init__(**kw)
        path = gate_path or gate_path_from_env()
        if path is None:
            raise ValueError(
                f"sparse.algorithm='seer' needs a trained gate: set {GATE_ENV}=PATH (train one with "
                f"`spin-cluster profile train-gate --model MODEL_FOLDER --page-size {self.page_size} --out PATH`)"
            )
        gate = load_gate(path, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, page_size=self.page_size, model_path=model_path)
        self.gate_meta = gate.meta
        self.w_q = gate.w_q.to(self.device)  # [L, Hkv, D, d_g]
        self.w_k = gate.w_k.to(self.device)  # [L, Hkv, 2D, d_g]
        d_g = self.w_q.shape[-1]
        L, Hkv, D, R = self.num_layers, self.num_kv_heads, self.head_dim, self.max_seqs
        self.keys = torch.zeros(L, R * self.max_pages_per_seq + 1, Hkv, d_g, dtype=self.index_dtype, device=self.device)
        self.open_sum = torch.zeros(L, R + 1, Hkv, D, device=self.device)
        self.open_max = torch.zeros(L, R + 1, Hkv, D, device=self.device)

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        T, dev = rows.shape[0], rows.device
        S = self.page_size
        page = rows * self.max_pages_per_seq + positions // S  # [T] flat page index
        run = _run_ids(page)  # [T]
        kf = k.float()
        total = torch.zeros_like(kf).index_add_(0, run, kf)  # [T, Hkv, D] per run (unused runs stay empty)
        peak = torch.full_like(kf, float("-inf")).scatter_reduce_(0, run[:, None, None].expand_as(kf), kf, "amax")
        start = torch.full((T,), torch.iinfo(torch.long).max, device=dev).scatter_reduce_(0, run, positions, "amin")
        end = torch.full((T,), -1, device=dev).scatter_reduce_(0, run, positions, "amax")
        run_row = torch.zeros(T, dtype=torch.long, device=dev).scatter_(0, run, rows)
        run_page = torch.zeros(T, dtype=torch.long, device=dev).scatter_(0, run, page)
        used = end >= 0  # [T]
        # A run that starts mid-page continues the row's open page from an earlier call.
        cont = (used & (start % S != 0))[:, None, None]
        total = total + torch.where(cont, self.open_sum[layer][run_row], 0.0)
        peak = torch.where(cont, torch.maximum(peak, self.open_max[layer][run_row]), peak)
        peak = torch.where(used[:, None, None], peak, 0.0)
        count = (end % S + 1).float()[:, None, None]  # tokens of the page so far
        k_gate = gate_keys(self.w_k[layer], total / count, peak)  # [T, Hkv, d_g]
        keys = self.keys[layer]
        keys.index_copy_(0, torch.where(used, run_page, keys.shape[0] - 1), k_gate.to(keys.dtype))
        # Each row's last run is its open page now.
        next_row = torch.cat([run_row[1:], run_row.new_full((1,), -1)])
        next_used = torch.cat([used[1:], used.new_zeros(1)])
        last = used & (~next_used | (next_row != run_row))
        slot = torch.where(last, run_row, self.max_seqs)
        self.open_sum[layer].index_copy_(0, slot, total)
        self.open_max[layer].index_copy_(0, slot, peak)

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]
        pages = rows[:, None] * self.max_pages_per_seq + torch.arange(num_pages, device=q.device)  # [B, P']
        q_gate = gate_queries(self.w_q[layer], q.float())  # [B, Hkv, d_g]
        k_gate = self.keys[layer][pages].float()  # [B, P', Hkv, d_g]
        return gate_logits(q_gate, k_gate, self.head_dim)


def _run_ids(page: torch.Tensor) -> torch.Tensor:
    """[T] flat page of each token -> [T] id of its run of consecutive equal pages, from 0."""
    change = torch.ones_like(page, dtype=torch.bool)
    change[1:] = page[1:] != page[:-1]
    return change.cumsum(0) - 1
