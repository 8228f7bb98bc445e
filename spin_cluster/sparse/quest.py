"""quest: per-page key bounds (element-wise min and max over the page's keys) as the index;
a page's score is the largest q.k any key inside those bounds could give (Quest, 2024).

    max over k in [kmin, kmax] of q.k = sum_d max(q_d kmin_d, q_d kmax_d)
                                      = q . (kmin + kmax) / 2 + |q| . (kmax - kmin) / 2

summed over the G query heads of each KV head, so Select is two batched mat-vecs per
layer instead of a [G, P, D] element-wise max.

Scoring blocks (``sparse.options.score_block_tokens``, default: the page): the bounds may be
kept per block of a page's tokens, and a page scores the best of its blocks. A bound over
fewer keys is tighter (it is the same bound when the page is one block), while Retrieve
still moves whole pages: smaller pages sharpen Select the same way, but at the cost of
4x-smaller PCIe transfers.

Index layout, per layer: ``kmin``/``kmax`` [N * nb + 1, Hkv, D] over N index pages and their
nb blocks (``index_page_ids``: a request row's pages in turn, or on the offloaded cache the
pages its directory hands out, N sized by what the cache holds; the extra last row absorbs
writes and reads of pages that have none, so that updates keep fixed shapes), in ``index_dtype``. A 16-bit index rounds outward (kmin down, kmax up, by at most one ulp of
slack) so that the bounds stay bounds; it halves the bytes Select reads, which at 128K tokens
and 2K budgets are more than Attention reads.

Two-level Select (``sparse.options.coarse_pages``: GP > 0, a power of two; ``coarse_factor``,
default 4; ``coarse_split``, default on: each of the row's two scoring stages spread over many
programs, in two launches; off: one launch, one program a row):
a second index of bounds over groups of GP pages (the min and max of their page rows, rebuilt
after each append), and Select scores the groups, keeps the
``ceil(budget * coarse_factor / GP)`` best per head and ranks only their pages
(``kernels/coarse_select.py``): at 128K tokens it reads about a tenth of the index bytes. Quest's
exact top-k wherever the kept groups hold its top pages; an approximation elsewhere, measured
in ``docs/accuracy.md``. Under the top-p rule or ``select_layer(fused=False)`` Select stays
exact Quest.

The page summary (``sparse.options.summary``): ``bounds`` (Quest's min and max), or ``moments``
(arXiv 2605.27740): each block's key mean mu and standard deviation sigma, kept as the box
[mu - z sigma, mu + z sigma] (``moments_z``, default 1), so that Select scores
q . mu + z |q| . sigma with the very same kernels and bytes as the bounds. One outlying key
stretches a min/max box over the whole range, and a page full of ordinary keys then outranks
the page that holds the needle; the moments track where a page's keys are. They are not
bounds. Each append keeps the blocks' running sums of k and k^2 (float32, beside the box) and
rewrites the touched boxes with a few torch ops (no Triton kernel yet).

On CUDA, with one scoring block per page, many rows and narrow selections, Select runs whole
in ``kernels/quest_select.py`` (``select_top``: scores, the hysteresis margin and the per-head
top-k in two launches, the same pages as the separate steps); elsewhere the separate steps are
faster (``quest_select.fused_pays``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spin_cluster.kernels.coarse_select import coarse_refresh, coarse_select
from spin_cluster.kernels.index_append import bounds_append_planned, fold_plan, plan_bounds_append
from spin_cluster.kernels.page_select import MAX_ROW_PAGES, page_scores
from spin_cluster.kernels.quest_select import fused_pays, quest_select
from spin_cluster.sparse.contract import SparseAlgorithm, register


class _MomentsPlan(NamedTuple):
    blocks: torch.Tensor  # [T] each token's block row
    fresh: torch.Tensor  # [T] the block to reset at the token (its first), else the dump row


@register
class Quest(SparseAlgorithm):
    name = "quest"
    graph_safe = True
    paged_index = True

    def __init__(self, score_block_tokens: int = 0, coarse_pages: int = 0, coarse_factor: int = 4,
                 coarse_split: bool = True, summary: str = "bounds", moments_z: float = 1.0, **kw) -> None:
        super().__init__(**kw)
        if summary not in ("bounds", "moments"):
            raise ValueError(f"sparse.options.summary={summary!r}: choose bounds (min/max) or moments (mean/std)")
        if not moments_z >= 0:
            raise ValueError(f"sparse.options.moments_z={moments_z}: must be >= 0")
        self.summary, self.moments_z = summary, float(moments_z)
        block = score_block_tokens or self.page_size
        if block < 1 or self.page_size % block:
            raise ValueError(f"sparse.options.score_block_tokens={score_block_tokens}: must divide the "
                             f"page size {self.page_size}")
        self.block_tokens = block
        self.blocks_per_page = self.page_size // block
        self.coarse_pages, self.coarse_factor, self.coarse_split = int(coarse_pages), int(coarse_factor), bool(coarse_split)
        GP = self.coarse_pages
        if GP:
            if GP < 2 or GP & (GP - 1) or GP > 64:
                raise ValueError(f"sparse.options.coarse_pages={coarse_pages}: must be 0 (off) or a power of two "
                                 "in 2..64")
            if self.blocks_per_page != 1:
                raise ValueError("sparse.options.coarse_pages needs one scoring block per page (score_block_tokens unset)")
            if self.coarse_factor < 1:
                raise ValueError(f"sparse.options.coarse_factor={coarse_factor}: must be >= 1")
        # A group's page rows must be consecutive: per request row, a stride of whole groups.
        self._row_stride = -(-self.max_pages_per_seq // GP) * GP if GP else self.max_pages_per_seq
        if GP and kw.get("index_pages") is None:
            self.num_index_pages = self.max_seqs * self._row_stride
        elif GP and self.num_index_pages % GP:
            raise ValueError(f"sparse.options.coarse_pages={GP} must divide the index's {self.num_index_pages} pages "
                             "(segments of BufferPolicy.segment_pages)")
        n = self.num_index_pages * self.blocks_per_page + 1
        shape = (self.num_layers, n, self.num_kv_heads, self.head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=self.index_dtype, device=self.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=self.index_dtype, device=self.device)
        if summary == "moments":  # running sums of k and k^2, and the keys counted, per block
            self.ksum = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.ksq = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.kcount = torch.zeros(shape[:2], dtype=torch.float32, device=self.device)
        if GP:  # group bounds, the last row a dump row (pages with no index row fall in it)
            cshape = (self.num_layers, self.num_index_pages // GP + 1, self.num_kv_heads, self.head_dim)
            self.cmin = torch.full(cshape, float("inf"), dtype=self.index_dtype, device=self.device)
            self.cmax = torch.full(cshape, float("-inf"), dtype=self.index_dtype, device=self.device)
        self._blocks: tuple | None = None  # (rows, n, [B, n] block rows) of the current step
        # The spread two-level Select's counts of finished programs a row, zero between
        # launches: made here, not inside a CUDA graph's capture (nor as a memset node in it).
        self._tickets = (torch.zeros(2 * self.max_seqs * self.num_kv_heads, dtype=torch.int32, device=self.device)
                         if GP and self.coarse_split else None)

    def bind_pages(self, logical_ids, segment_pages):
        if self.coarse_pages and segment_pages % self.coarse_pages:
            raise ValueError(f"sparse.options.coarse_pages={self.coarse_pages} must divide the cache's segments of "
                             f"{segment_pages} pages (BufferPolicy.segment_pages)")
        super().bind_pages(logical_ids, segment_pages)

    def index_page_ids(self, rows, pages):
        if self._logical_ids is None and self._row_stride != self.max_pages_per_seq:
            return rows * self._row_stride + pages
        return super().index_page_ids(rows, pages)

    def _score_blocks(self, rows, n):
        """[B, n] index rows of each request's first n scoring blocks. Every layer of a step
        scores the same rows (one ``rows`` tensor per step), so they are built once per step:
        three launches, not three per layer."""
        cached = self._blocks
        if cached is not None and cached[0] is rows and cached[1] == n:
            return cached[2]
        nb = self.blocks_per_page
        pages = torch.arange(n // nb, device=rows.device)
        ids = self.index_page_ids(rows[:, None], pages[None])[..., None]  # [B, P', 1]
        # A page with no index page (past the context) reads the last row: Select masks it.
        blocks = torch.where(ids >= 0, ids * nb + torch.arange(nb, device=rows.device), self.kmin.shape[1] - 1)
        blocks = blocks.flatten(1)  # [B, P' * nb]
        self._blocks = (rows, n, blocks)
        return blocks

    def index_bytes_per_token(self) -> float:
        # kmin and kmax: two D-wide bounds per scoring block; two-level, per group of pages
        # (plus the kept groups' page bounds, which follow the budget as the attention does)
        return self._bound_bytes() / (self.block_tokens * (self.coarse_pages or 1))

    def index_bytes_held_per_token(self) -> float:
        # Every page's bounds, and two-level the group bounds over them as well; the moments'
        # float32 sums beside the box.
        held = self._bound_bytes() / self.block_tokens
        if self.summary == "moments":
            held += 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4 / self.block_tokens
        return held * (1 + 1 / self.coarse_pages) if self.coarse_pages else held

    def _bound_bytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kmin.element_size()

    def on_append(self, layer, rows, positions, k):
        # rows, positions: [T]; k: [T, Hkv, D]
        self.append(layer, self.plan_append(rows, positions), k)

    def plan_append(self, rows, positions, decode_only=False):
        """Once per step: [T] flat block row of each token and [T] positions (a token at a
        block's start resets it), planned for the append of every layer. Two-level: and the
        group rows to rebuild, none in a decode step (the Select rebuilds each request's last
        group, the only one its decode token changed, before it reads it)."""
        S = self.page_size
        pages = self.index_page_ids(rows, positions // S)
        blocks = torch.where(pages >= 0, pages * self.blocks_per_page + (positions % S) // self.block_tokens,
                             self.kmin.shape[1] - 1)
        if self.summary == "moments":  # the bounds' reset rule: a block's first token resets it
            fresh, _ = fold_plan(blocks, positions, self.block_tokens, self.kmin.shape[1], self.kmin.shape[2:])
            plan = _MomentsPlan(blocks, fresh)
        else:
            plan = plan_bounds_append(blocks, positions, self.block_tokens, self.kmin.shape[1], self.kmin.shape[2:])
        # Two-level: the group row of each token (the dump page row falls in the dump group row).
        if not self.coarse_pages:
            return plan
        return plan, None if decode_only else blocks // self.coarse_pages

    def append(self, layer, plan, k):
        # One Triton launch on CUDA (bounds rounded outward in a 16-bit index), else torch ops;
        # two-level, one more: the touched group rows rebuilt from their pages' bounds.
        groups = None
        if self.coarse_pages:
            plan, groups = plan
        if self.summary == "moments":
            self._append_moments(layer, plan, k)
        else:
            bounds_append_planned(self.kmin[layer], self.kmax[layer], k, plan)
        if groups is not None:
            coarse_refresh(self.kmin[layer], self.kmax[layer], self.cmin[layer], self.cmax[layer], groups,
                           self.coarse_pages)

    def _append_moments(self, layer, plan: _MomentsPlan, k) -> None:
        """k [T, Hkv, D] into its blocks' sums (a block's first token resets it), then the
        touched blocks' boxes rewritten as mean -+ z std. A block touched by several tokens is
        written several times with one value: fixed shapes, no host sync (graph-safe)."""
        blocks, fresh = plan
        ksum, ksq, count = self.ksum[layer], self.ksq[layer], self.kcount[layer]
        for t in (ksum, ksq, count):
            t.index_fill_(0, fresh, 0.0)
        k = k.float()
        ksum.index_add_(0, blocks, k)
        ksq.index_add_(0, blocks, k * k)
        count.index_add_(0, blocks, torch.ones_like(blocks, dtype=torch.float32))
        n = count[blocks][:, None, None]  # [T, 1, 1]
        mean = ksum[blocks] / n  # [T, Hkv, D]
        radius = self.moments_z * (ksq[blocks] / n - mean * mean).clamp_min(0).sqrt()
        self.kmin[layer].index_copy_(0, blocks, (mean - radius).to(self.kmin.dtype))
        self.kmax[layer].index_copy_(0, blocks, (mean + radius).to(self.kmax.dtype))

    def score(self, layer, q, rows, num_pages):
        # q: [B, H, D] -> [B, Hkv, num_pages]; Triton on CUDA, the torch reference elsewhere
        nb = self.blocks_per_page
        blocks = self._score_blocks(rows, num_pages * nb)  # [B, P' * nb]
        scores = page_scores(q, self.kmin[layer], self.kmax[layer], blocks)  # [B, Hkv, P' * nb]
        if nb == 1:
            return scores
        # A page scores its best block. Blocks no token reached yet (in the tail page, or past
        # the context) have empty bounds (inf, -inf), whose score is NaN: they count as -inf.
        return scores.nan_to_num_(nan=float("-inf")).view(*scores.shape[:2], num_pages, nb).amax(-1)

    def select_top(self, layer, q, rows, plan, held, margin, force=False):
        # On CUDA, one page per scoring block, where it pays (``fused_pays``: many rows,
        # narrow selections): scores, margin and top-k in two launches
        # (``kernels/quest_select.py``), else the separate steps. Two-level: always its own
        # Select (one launch on CUDA, its torch reference elsewhere).
        if self.coarse_pages:
            pages = self._score_blocks(rows, plan.max_pages)
            return coarse_select(q, self.kmin[layer], self.kmax[layer], self.cmin[layer], self.cmax[layer], pages,
                                 plan.num_pages, plan.sink_pages, plan.local_pages, plan.budget_pages,
                                 plan.budget_width, self.coarse_pages, self.coarse_factor, held, margin,
                                 plan.dense_rows, max_budget=plan.max_budget, split=self.coarse_split,
                                 tickets=self._tickets)
        if not q.is_cuda or self.blocks_per_page != 1 or plan.max_pages > MAX_ROW_PAGES:
            return None
        if not force and not fused_pays(q.shape[0] * self.num_kv_heads, plan.budget_width):
            return None
        pages = self._score_blocks(rows, plan.max_pages)  # [B, P]
        return quest_select(q, self.kmin[layer], self.kmax[layer], pages, plan.num_pages, plan.sink_pages,
                            plan.local_pages, plan.budget_pages, plan.budget_width, held, margin, plan.dense_rows)
