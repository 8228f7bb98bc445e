"""Block-sparse prefill: which key blocks each (KV head, query block) of a prompt chunk attends to.

The sparse contract's operations, at block granularity over the chunk's queries:

    Index      pool the keys per block (pooled) or sample them on antidiagonals (antidiagonal)
    Select     estimate each key block's share of each query block's attention mass, then
               keep the sink blocks, the local band and the diagonal block and add the best
               middle blocks up to the head's budget, through the same ``select_pages`` that
               picks decode pages (a query block is a "request", its causal key blocks its
               "pages")
    Attention  ``block_sparse_prefill``: a FlashAttention-2 kernel over the listed blocks

Budgets (``sparse.prefill.options.budgets``), in middle key blocks per query block, each a
fraction (0, 1) of the query block's middle blocks or a count >= 1:

    uniform     ``budget`` for every (layer, KV head)
    threshold   online, per (KV head, query block): the fewest best middle blocks whose
                estimated mass, added to the kept blocks', reaches ``threshold`` (XAttention)
    per_head    offline, per (layer, KV head): ``per_head_budgets``, or S-HPLB max-min shifting
                of ``budget`` by the heads' needs in a profile

Queries and keys use the same blocks, aligned to position 0 (see
``spin_cluster.kernels.block_sparse_prefill``), so a chunk that starts mid-block still has
one diagonal block per query block. Shapes: n chunk tokens at positions cs .., T = cs + n
context positions, H query heads, Hkv KV heads, D head dim, M query blocks, J key blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spin_cluster.config import BlockPrefillOptions
from spin_cluster.dense_attention import dense_causal_attention
from spin_cluster.hplb import PlanConfig, plan_heads
from spin_cluster.hplb.profile import load_profile
from spin_cluster.kernels.block_sparse_prefill import block_sparse_prefill, num_query_blocks
from spin_cluster.kernels.prefill_estimate import strided_block_masses
from spin_cluster.sparse.select import SelectPlan, select_pages

# Scores held at once by the antidiagonal estimate ([rows, J * bs / stride] fp32 per chunk).
_ESTIMATE_CHUNK_ELEMENTS = 1 << 26


# ---- Index + estimate ------------------------------------------------------------------------


def block_masses(q: torch.Tensor, k: torch.Tensor, context_start: int, block_size: int,
                 estimator: str = "antidiagonal", stride: int = 8) -> torch.Tensor:
    """Estimated attention mass of each key block for each query block: [Hkv, M, J] float32,
    0 right of the diagonal, each row summing to 1 (mean over the KV head's G query heads).

    q: [n, H, D] at positions cs .. cs + n - 1; k: [Hkv, >= T, D].

    antidiagonal (XAttention): with s = stride, a stride-s row of queries is paired with a
    stride-s row of keys by summing q.k along one antidiagonal of their s x s tile::

        score(a, b) = sum_i q[a*s + s-1-i] . k[b*s + i]

    a softmax over b gives each strided query row's mass, and summing the s x s tiles of a
    block pair gives the block's mass: (T/s)^2 dot products of length s*D, 1/s^2 of dense.
    pooled: softmax over key blocks of (block-mean q) . (block-mean k): (T/bs)^2 dots.
    strided: softmax over key blocks of (stride-mean q) . (block-mean k) for every group of
    ``stride`` queries, summed over a query block's groups: (T/s)(T/bs) dots, 0.8 ms a
    layer at 128K on an H200 in one fused kernel (the antidiagonal estimate's dots are s*D
    long and (T/s)^2 many).
    """
    n, H, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    first = context_start // block_size
    M = num_query_blocks(context_start, n, block_size)
    J = first + M
    if estimator == "strided":
        # Fused on CUDA, the [G*R, J] logits kept on chip (the torch estimate writes and
        # rereads them in fp32: about 5 ms a layer at 128K on an H200).
        return strided_block_masses(q, k, context_start, block_size, stride)
    # Queries placed at their positions within whole blocks; rows outside the chunk are zero.
    lead = context_start - first * block_size
    q_blocks = q.new_zeros(M * block_size, H, D)
    q_blocks[lead:lead + n] = q
    k_blocks = k.new_zeros(Hkv, J * block_size, D)
    k_blocks[:, :context_start + n] = k[:, :context_start + n]
    row_in_chunk = torch.zeros(M * block_size, dtype=torch.bool, device=q.device)
    row_in_chunk[lead:lead + n] = True
    if estimator == "pooled":
        rows = row_in_chunk.view(M, block_size).sum(-1).clamp(min=1)  # [M]
        q_mean = q_blocks.float().view(M, block_size, H, D).sum(1) / rows[:, None, None]  # [M, H, D]
        keys = torch.arange(J * block_size, device=q.device) < context_start + n
        counts = keys.view(J, block_size).sum(-1).clamp(min=1)  # [J]
        k_mean = k_blocks.float().view(Hkv, J, block_size, D).sum(2) / counts[None, :, None]  # [Hkv, J, D]
        k_mean = k_mean.repeat_interleave(G, dim=0)  # [H, J, D]
        logits = torch.einsum("mhd,hjd->hmj", q_mean, k_mean) * D**-0.5  # [H, M, J]
        causal = torch.arange(J, device=q.device)[None, :] <= (first + torch.arange(M, device=q.device))[:, None]
        mass = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return mass.view(Hkv, G, M, J).mean(1)
    if estimator != "antidiagonal":
        raise ValueError(f"estimator={estimator!r}: choose antidiagonal, pooled or strided")
    return _antidiagonal_masses(q_blocks, k_blocks, row_in_chunk, first, block_size, stride)


def _antidiagonal_masses(q_blocks, k_blocks, row_in_chunk, first, block_size, stride):
    """q_blocks [M*bs, H, D], k_blocks [Hkv, J*bs, D] -> [Hkv, M, J] (see ``block_masses``)."""
    MB, H, D = q_blocks.shape
    Hkv, JB, _ = k_blocks.shape
    G, s, M, J = H // Hkv, stride, MB // block_size, JB // block_size
    per = block_size // s  # strided rows per block
    # [R, s, H, D] -> reversed within each stride group -> [H, R, s*D]; keys [Hkv, C, s*D].
    qs = q_blocks.view(MB // s, s, H, D).flip(1).permute(2, 0, 1, 3).reshape(H, MB // s, s * D)
    ks = k_blocks.reshape(Hkv, JB // s, s * D)
    # A strided query row counts if its first query is in the chunk (one weight per row).
    weight = row_in_chunk.view(MB // s, s)[:, 0].float()  # [R]
    q_row = first * per + torch.arange(MB // s, device=q_blocks.device)  # strided position
    k_row = torch.arange(JB // s, device=q_blocks.device)
    scale = D**-0.5 / s
    out = q_blocks.new_zeros(Hkv, M, J, dtype=torch.float32)
    blocks_per_chunk = max(1, _ESTIMATE_CHUNK_ELEMENTS // (G * block_size // s * JB // s))
    for h in range(Hkv):
        for m0 in range(0, M, blocks_per_chunk):
            r = slice(m0 * per, min(M, m0 + blocks_per_chunk) * per)
            # In the inputs' dtype (tensor cores on a GPU), softmax in fp32: an estimate only ranks.
            logits = torch.matmul(qs[h * G:(h + 1) * G, r], ks[h].T).float() * scale  # [G, rows, C]
            logits.masked_fill_(k_row[None, None, :] > q_row[r, None], float("-inf"))
            p = logits.softmax(-1) * weight[r, None]  # [G, rows, C]
            rows = p.shape[1] // per
            p = p.view(G, rows, per, J, per).sum((0, 2, 4))  # [rows(blocks), J]
            out[h, m0:m0 + rows] = p
    return out / out.sum(-1, keepdim=True).clamp(min=1e-30)


# ---- Select --------------------------------------------------------------------------------


def middle_blocks(context_start: int, num_tokens: int, block_size: int, sink_blocks: int,
                  local_blocks: int, device: torch.device) -> torch.Tensor:
    """[M] key blocks of each query block that are neither sink, local band nor diagonal."""
    first = context_start // block_size
    M = num_query_blocks(context_start, num_tokens, block_size)
    visible = first + 1 + torch.arange(M, device=device)  # causal key blocks, diagonal included
    return (visible - sink_blocks - local_blocks - 1).clamp(min=0)


def budget_blocks(budgets: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
    """budgets [Hkv] (fraction < 1, or count >= 1), middle [M] -> [Hkv, M] int64 blocks."""
    b = budgets.to(torch.float64)[:, None]
    return torch.where(b < 1, torch.ceil(b * middle[None, :]), torch.floor(b)).long()


def threshold_blocks(masses: torch.Tensor, context_start: int, block_size: int, sink_blocks: int,
                     local_blocks: int, threshold: float) -> torch.Tensor:
    """[Hkv, M] the fewest middle blocks whose mass, with the kept blocks', reaches threshold."""
    Hkv, M, J = masses.shape
    first = context_start // block_size
    j = torch.arange(J, device=masses.device)
    diag = first + torch.arange(M, device=masses.device)[:, None]  # [M, 1]
    kept = (j < sink_blocks) | ((j >= diag - local_blocks) & (j <= diag))  # [M, J]
    middle = (j <= diag) & ~kept
    have = (masses * kept).sum(-1)  # [Hkv, M]
    val = torch.where(middle, masses, -1.0).sort(-1, descending=True).values  # [Hkv, M, J]
    before = val.clamp(min=0).cumsum(-1) - val.clamp(min=0)  # mass of the better blocks
    return ((have[..., None] + before < threshold) & (val >= 0)).sum(-1)


def select_blocks(masses: torch.Tensor, budgets: torch.Tensor, context_start: int, block_size: int,
                  sink_blocks: int, local_blocks: int, max_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """masses [Hkv, M, J], budgets [Hkv, M] middle blocks -> (block_ids [Hkv, M, K] int32
    ascending, -1 padded; num_blocks [Hkv, M] int32) for ``block_sparse_prefill``."""
    Hkv, M, J = masses.shape
    first = context_start // block_size
    dev = masses.device
    plan = SelectPlan(
        num_pages=first + 1 + torch.arange(M, device=dev),  # causal key blocks per query block
        tail_len=torch.ones(M, dtype=torch.int32, device=dev),  # unused: blocks are whole here
        sink_pages=sink_blocks,
        local_pages=local_blocks + 1,  # the band and the diagonal
        budget_pages=budgets.T.contiguous(),  # [M, Hkv]
        max_pages=J,
        max_budget=max(0, min(max_budget, J)),
    )
    want, num = select_pages(masses.transpose(0, 1), False, plan, Hkv)  # [M, Hkv, K], [M, Hkv]
    return want.transpose(0, 1).int().contiguous(), num.T.int().contiguous()


# ---- Budgets from a profile -----------------------------------------------------------------


def shifted_budgets(needs: Sequence[Sequence[float]], mean_fraction: float, resolution: int = 1000) -> list[list[float]]:
    """S-HPLB per-head fractions: ``mean_fraction`` on average, shifted from heads that need
    few middle blocks to heads that need many by max-min water-filling
    (``spin_cluster.hplb.plan_heads`` on the needs), in steps of 1/resolution. needs: [L][Hkv]
    fractions (0..1) of the middle blocks each head needs."""
    # Fractions as whole units of a context of ``resolution``: needs, and the uniform budget
    # whose total is shifted, become token counts there.
    units = [[max(1, round(f * resolution)) for f in row] for row in needs]
    config = PlanConfig(num_layers=len(units), num_kv_heads=len(units[0]) if units else 0, context_tokens=resolution,
                        budget_tokens=round(mean_fraction * resolution), unit_tokens=1)
    shares = plan_heads(units, config).budgets
    return [[min(u, resolution - 1) / resolution for u in row] for row in shares]


def profile_budgets(config: BlockPrefillOptions) -> list[list[float]]:
    """``per_head`` budgets from ``config.profile``: its heads' need fractions at
    ``config.coverage``, shifted around the mean ``config.budget``."""
    needs = load_profile(config.profile).need_fractions(config.coverage)
    return shifted_budgets(needs.tolist(), config.budget)


def head_needs(masses: Sequence[torch.Tensor], context_start: int, num_tokens: int, block_size: int,
               sink_blocks: int, local_blocks: int, coverage: float) -> list[list[float]]:
    """[L][Hkv] fraction of its middle blocks each head needs to reach ``coverage``, from one
    chunk's estimated masses per layer ([Hkv, M, J] each): the offline measurement behind
    per-head budgets when no profile file exists. Query blocks with no middle block are left out."""
    middle = middle_blocks(context_start, num_tokens, block_size, sink_blocks, local_blocks, masses[0].device)
    ok = middle > 0
    if not ok.any():
        return [[0.0] * mass.shape[0] for mass in masses]
    out = []
    for mass in masses:
        need = threshold_blocks(mass, context_start, block_size, sink_blocks, local_blocks, coverage)  # [Hkv, M]
        out.append((need[:, ok].double() / middle[ok]).mean(-1).tolist())
    return out


# ---- Equal-cost calibration ------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillCalibration:
    """Budgets that compute as many key blocks as uniform ``budget`` on a calibration prompt."""

    threshold: float  # the threshold mode's mass
    per_head_budgets: tuple[tuple[float, ...], ...]  # [L][Hkv] S-HPLB fractions
    density: float  # computed / causal key blocks of uniform budget on the prompt


class _MassRecorder:
    """LayerAttention for one whole prompt in one forward: dense causal SDPA, and each
    layer's estimated block masses."""

    def __init__(self, config: BlockPrefillOptions) -> None:
        self.config = config
        self.masses: list[torch.Tensor] = []

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.config
        k_ctx, v_ctx = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
        self.masses.append(block_masses(q, k_ctx, 0, c.block_size, c.estimator, c.stride))
        return dense_causal_attention(q, k_ctx, v_ctx, 0)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, prompt_ids: Sequence[int], config: BlockPrefillOptions) -> PrefillCalibration:
    """One dense forward of ``prompt_ids``; then the threshold (by bisection) and the S-HPLB
    per-head budgets (heads' needs at ``config.coverage``, shifted around ``config.budget``)
    whose key-block count matches uniform ``config.budget`` (a fraction) on that prompt."""
    if not 0 < config.budget < 1:
        raise ValueError(f"calibration matches a uniform fraction; got sparse.prefill.options.budget={config.budget}")
    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    recorder = _MassRecorder(config)
    model(ids, torch.arange(len(ids), device=device), recorder)
    c, T = config, len(ids)
    middle = middle_blocks(0, T, c.block_size, c.sink_blocks, c.local_blocks, device)  # [M]
    visible = torch.arange(1, middle.numel() + 1, device=device)
    kept = (visible - middle).sum().item() * recorder.masses[0].shape[0]

    def total(blocks: list[torch.Tensor]) -> float:
        return sum(kept + torch.minimum(b, middle).sum().item() for b in blocks)

    uniform = total([budget_blocks(torch.full((m.shape[0],), c.budget, device=device), middle) for m in recorder.masses])
    lo, hi = 0.0, 1.0
    for _ in range(30):  # the largest threshold that computes no more blocks than uniform
        mid = (lo + hi) / 2
        needed = [threshold_blocks(m, 0, c.block_size, c.sink_blocks, c.local_blocks, mid) for m in recorder.masses]
        lo, hi = (mid, hi) if total(needed) <= uniform else (lo, mid)
    needs = head_needs(recorder.masses, 0, T, c.block_size, c.sink_blocks, c.local_blocks, c.coverage)
    per_head = tuple(tuple(row) for row in shifted_budgets(needs, c.budget))
    causal = visible.sum().item() * recorder.masses[0].shape[0] * len(recorder.masses)
    return PrefillCalibration(lo, per_head, uniform / causal)


# ---- The engine's prefill attention ----------------------------------------------------------


class BlockSparsePrefill:
    """Prefill attention of the engine's backends: select blocks per (KV head, query block),
    then the block-sparse kernel (Triton on CUDA, the torch reference elsewhere).

    Counts the blocks it computes (``computed_blocks``) against the causal blocks dense
    prefill would (``causal_blocks``), on the device, per (layer, KV head) summed."""

    def __init__(self, config: BlockPrefillOptions, num_layers: int, num_kv_heads: int,
                 device: torch.device) -> None:
        self.config = config
        self.device = device
        rows = self._budget_rows(config, num_layers, num_kv_heads)
        self._budgets = torch.tensor(rows, dtype=torch.float64, device=device)  # [L, Hkv]
        self._fraction_max = [max((b for b in row if b < 1), default=0.0) for row in rows]
        self._count_max = [max((int(b) for b in row if b >= 1), default=0) for row in rows]
        self.computed_blocks = torch.zeros((), dtype=torch.long, device=device)
        self.causal_blocks = torch.zeros((), dtype=torch.long, device=device)

    @staticmethod
    def _budget_rows(config: BlockPrefillOptions, num_layers: int, num_kv_heads: int) -> list[list[float]]:
        if config.budgets != "per_head":
            return [[config.budget] * num_kv_heads for _ in range(num_layers)]
        rows = config.per_head_budgets or profile_budgets(config)
        if len(rows) != num_layers or any(len(r) != num_kv_heads for r in rows):
            raise ValueError(f"sparse.prefill.options per-head budgets are {len(rows)} x {len(rows[0]) if rows else 0}; "
                             f"this model needs [{num_layers}][{num_kv_heads}] (layers x KV heads)")
        return [list(r) for r in rows]

    def density(self) -> float:
        """Computed / causal key blocks so far (one host sync)."""
        return self.computed_blocks.item() / max(1, self.causal_blocks.item())

    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, context_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, H, D], k [Hkv, >= T, D] -> (block_ids [Hkv, M, K], num_blocks [Hkv, M])."""
        c = self.config
        n = q.shape[0]
        masses = block_masses(q, k, context_start, c.block_size, c.estimator, c.stride)  # [Hkv, M, J]
        middle = middle_blocks(context_start, n, c.block_size, c.sink_blocks, c.local_blocks, q.device)  # [M]
        J = masses.shape[-1]
        if c.budgets == "threshold":
            budgets = threshold_blocks(masses, context_start, c.block_size, c.sink_blocks, c.local_blocks, c.threshold)
            max_budget = J
        else:
            budgets = budget_blocks(self._budgets[layer], middle)
            max_budget = max(math.ceil(self._fraction_max[layer] * J), self._count_max[layer])
        return select_blocks(masses, budgets, context_start, c.block_size, c.sink_blocks, c.local_blocks, max_budget)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int) -> torch.Tensor:
        """q [n, H, D]; k, v [Hkv, T, D] -> [n, H, D]: ``prefill_attention``'s contract."""
        k, v = k.to(q.dtype), v.to(q.dtype)
        block_ids, num_blocks = self.select(layer, q, k, context_start)
        self.computed_blocks += num_blocks.sum()
        self.causal_blocks += (context_start // self.config.block_size + 1
                               + torch.arange(num_blocks.shape[1], device=q.device)).sum() * num_blocks.shape[0]
        return block_sparse_prefill(q, k, v, block_ids, num_blocks, context_start, self.config.block_size)
