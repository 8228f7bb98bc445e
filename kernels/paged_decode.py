"""Paged decode attention: one new query token per request against a paged KV cache.

KV layout (per-head pages, see ``spin_cluster.kvcache.page_pool``): a physical page holds
``S`` consecutive tokens of ONE (layer, KV head)::

    k_pages, v_pages : [N, S, D]      N physical pages of any layer / head
    block_tables     : [B, Hkv, P]    int32, physical id of the p-th logical page of each
                                      (request, KV head); entries past the request's length
                                      are padding and never read
    seq_lens         : [B] or [B, Hkv] int32, tokens in cache per request (or per request
                                      and KV head: sparse decode attends to a different
                                      number of selected tokens per head), the current token
                                      included (already written)
    key_starts       : [B] int32 or None, each request's first key: positions before it are
                                      masked (a sliding window's keys, its first page first
                                      in the table); 0 <= key_starts[b] < seq_lens[b]
    q                : [B, H, D]      H = Hkv * G; query head h reads KV head h // G
    returns          : [B, H, D]      in q's dtype

Entry points with the same signature:

* :func:`paged_decode_attention` -- Triton kernel (CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1``). Never syncs with the host, so it can be captured in a CUDA graph.
* :func:`paged_decode_attention_ref` -- pure torch, vectorised over (request, KV head) rows;
  the test oracle.
* The CPU's paths (``paged_decode_cpu``): one gather per group of requests and PyTorch's
  fused attention over it, and the same gather planned once a step for every layer.

Both accumulate in fp32, take fp32 / bf16 / fp16, any page size and any head dim (the kernel
pads D to a power of 2 >= 16 with masking, up to 256). A request with ``seq_len == 0`` (e.g.
batch padding) gets zeros.

This module imports only torch (and Triton, lazily): it must not import ``spin_cluster``.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton_support import is_interpreted, load_kernel_module, next_pow2, triton_importable
from .paged_decode_checks import check_inputs, host_lens, resolve_scale

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "balanced_split_tokens",
    "choose_num_splits",
    "triton_available",
]

_LOG2E = 1.4426950408889634

# Split-K heuristic (flash-decoding). The main kernel at D=128 (4 warps, ~107 registers per
# thread, ~38 KB shared memory) keeps 4 programs resident per SM on an H200, so one "wave" is
# 4 * 132 = 528 programs. Measured there (B=1, Hkv=8, 128K tokens): 64 splits (512 programs)
# read K/V at ~4.06 TB/s, 80 splits (640, two waves) ~3.2 TB/s, 32 splits ~3.3 TB/s.
_PROGRAMS_PER_SM = 4
# Below this a split costs more than it saves. 128, not 256: Spin's rows are a head's selected
# tokens (~2K), where 16 splits of 128 beat 8 of 256 (H100, bench_paged_decode.py --sweep,
# 2026-12-06: 10.9 against 12.3 us at B=4 x 2048 tokens, 6.7 against 9.2 at B=1).
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
_SPLIT_COST_TOKENS = 128  # fixed cost of one program (set-up, partial write), in tokens read
_SPLIT_MIN_GAIN = 0.01  # more splits only for an estimated gain above 1%
_MAX_HEAD_DIM = 256  # kernel limit (register tile [16, D] + [BLOCK_N, D])
_NUM_WARPS = 4
_NUM_STAGES = 2

# The reference gathers K/V of a chunk of (request, KV head) rows in fp32, under this many
# bytes: on a GPU, large chunks (few launches); on the CPU, about 2 MiB per thread, so the
# gather and bf16->fp32 conversion stay in cache (measured 3-5x faster on a 2-core host than
# with 256 MiB chunks, e.g. B=64, Hkv=8, D=128, 4K tokens bf16: 805 -> ~160 ms).
_REF_CHUNK_BYTES = 256 * 1024 * 1024
_REF_CHUNK_BYTES_CPU_PER_THREAD = 2 * 1024 * 1024


# --------------------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------------------


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    key_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch paged decode attention (same contract as :func:`paged_decode_attention`).

    Works on (request, KV head) rows, each with its ``G`` query heads: rows are sorted by
    length (longest first) and taken in chunks whose gathered fp32 K/V stays under a budget
    (~2 MiB per thread on the CPU so the bf16->fp32 conversion stays in cache, 256 MiB on a
    GPU). Each chunk gathers its pages through the block table, masks tokens past
    ``seq_lens`` and runs an fp32 softmax with batched matmuls. Reads ``seq_lens`` on the
    host (one sync), so it is not for CUDA-graph capture.
    """
    B, H, Hkv, G, D, S, P = check_inputs(q, k_pages, v_pages, block_tables, seq_lens, out)
    _check_starts(key_starts, B)
    scale = resolve_scale(scale, D)
    dev = q.device

    lens_host = host_lens(seq_lens, P * S)

    R = B * Hkv  # rows: (request, KV head)
    row_lens = lens_host.reshape(-1) if lens_host.dim() == 2 else lens_host.repeat_interleave(Hkv)  # [R]
    # Longest first, so a chunk's padding to its longest row stays small.
    order_host = torch.argsort(row_lens, descending=True, stable=True)
    sorted_lens = row_lens[order_host]
    n_live = int((sorted_lens > 0).sum())
    result = torch.zeros(R, G, D, dtype=torch.float32, device=dev)
    if n_live == 0:
        return _ref_finish(result.view(B, H, D), q, out)

    order = order_host[:n_live].to(dev)
    lens_sorted = sorted_lens[:n_live].to(dev)  # [n_live]
    starts_sorted = None if key_starts is None else key_starts.long().repeat_interleave(Hkv)[order]
    # Page ids of the live rows in sorted order; padding entries (past each row's length,
    # arbitrary values) replaced by page 0 so that the gather stays in range.
    bt_rows = block_tables.reshape(R, P).index_select(0, order).long()
    page_ok = torch.arange(P, device=dev)[None, :] < ((lens_sorted + S - 1) // S)[:, None]
    bt_rows = torch.where(page_ok, bt_rows, torch.zeros_like(bt_rows))
    q_rows = q.reshape(R, G, D).index_select(0, order).float()  # [n_live, G, D]
    o_rows = torch.empty(n_live, G, D, dtype=torch.float32, device=dev)

    if dev.type == "cuda":
        budget = _REF_CHUNK_BYTES
    else:
        budget = _REF_CHUNK_BYTES_CPU_PER_THREAD * max(1, torch.get_num_threads())
    per_token_bytes = 2 * D * (4 + k_pages.element_size()) + G * 4 * 2
    sorted_list = sorted_lens[:n_live].tolist()
    i = 0
    while i < n_live:
        t_max = -(-sorted_list[i] // S) * S  # chunk's longest row, padded to whole pages
        c = max(1, min(n_live - i, budget // (per_token_bytes * t_max)))
        n_pages = t_max // S
        ids = bt_rows[i : i + c, :n_pages].reshape(-1)
        k = k_pages.index_select(0, ids).view(c, t_max, D).float()
        v = v_pages.index_select(0, ids).view(c, t_max, D).float()
        scores = torch.bmm(q_rows[i : i + c], k.transpose(1, 2)).mul_(scale)  # [c, G, t_max]
        if sorted_list[i + c - 1] < t_max or starts_sorted is not None:  # keys to mask
            pos = torch.arange(t_max, device=dev)[None, :]
            tok_ok = pos < lens_sorted[i : i + c, None]
            if starts_sorted is not None:
                tok_ok &= pos >= starts_sorted[i : i + c, None]
            scores.masked_fill_(~tok_ok[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        torch.bmm(probs, v, out=o_rows[i : i + c])
        i += c
    result.index_copy_(0, order, o_rows)
    return _ref_finish(result.view(B, H, D), q, out)


def _check_starts(key_starts: torch.Tensor | None, B: int) -> None:
    if key_starts is not None and (key_starts.shape != (B,) or key_starts.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"key_starts must be [B={B}] int32 or int64, got {tuple(key_starts.shape)} "
                         f"{key_starts.dtype}")


def _ref_finish(result: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


# --------------------------------------------------------------------------------------
# Triton kernel launcher
# --------------------------------------------------------------------------------------


_KERNELS = ("_paged_decode_kernel", "paged_decode_attention", "paged_decode_attention_ref")


def _load_kernels():
    return load_kernel_module(*_KERNELS)


def triton_available() -> bool:
    return triton_importable(*_KERNELS)


@functools.lru_cache(maxsize=16)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count




def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Flash-decoding split count for a grid of ``batch * num_kv_heads * splits`` programs.

    Estimates the run time of requests of ``max_tokens`` tokens as
    ``waves * (max_tokens / splits + _SPLIT_COST_TOKENS)``, a wave being
    ``_PROGRAMS_PER_SM * num_sms`` resident programs, and returns the best split count (more
    splits only for a >1% better estimate), at most ``_MAX_SPLITS`` and without splits
    shorter than ``_MIN_TOKENS_PER_SPLIT`` tokens. A partial last wave is thereby avoided:
    on 132 SMs, B=1, Hkv=8, 128K tokens -> 64 splits (512 programs); B=32, Hkv=8 -> 2 (512
    programs; 3 would give 768 = 1.5 waves, measured ~15% slower); B*Hkv >= 528 -> 1.
    """
    programs = max(1, batch * num_kv_heads)
    slots = max(1, _PROGRAMS_PER_SM * num_sms)
    tokens = max(1, max_tokens)
    cap = max(1, min(_MAX_SPLITS, -(-tokens // _MIN_TOKENS_PER_SPLIT)))
    best, best_cost = 1, None
    for splits in range(1, cap + 1):
        waves = -(-(programs * splits) // slots)
        cost = waves * (tokens / splits + _SPLIT_COST_TOKENS)
        if best_cost is None or cost < best_cost * (1.0 - _SPLIT_MIN_GAIN):
            best, best_cost = splits, cost
    return best


def balanced_split_tokens(batch: int, num_kv_heads: int, mean_tokens: float, max_tokens: int, num_sms: int,
                          block_n: int = 64) -> int:
    """``split_tokens`` for rows of ``mean_tokens`` on average and ``max_tokens`` at most: the
    total cut into about a wave of programs (``_PROGRAMS_PER_SM`` a SM), no split under
    ``_MIN_TOKENS_PER_SPLIT`` tokens, and no row over ``_MAX_SPLITS`` splits (the reduce
    merges a row's splits as one tile), rounded up to ``block_n``."""
    total = batch * num_kv_heads * max(1.0, mean_tokens)
    tokens = max(_MIN_TOKENS_PER_SPLIT, math.ceil(total / (_PROGRAMS_PER_SM * num_sms)),
                 -(-max(1, max_tokens) // _MAX_SPLITS))
    return -(-tokens // block_n) * block_n


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    max_seq_len: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_starts: torch.Tensor | None = None,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention. See the module docstring for the layout (``key_starts``
    included: blocks wholly before a row's first key are not visited).

    Keyword-only tuning knobs:
      num_splits   split each request's tokens over this many programs (flash-decoding,
                   merged by a second kernel); default from :func:`choose_num_splits`.
      split_tokens balanced splits instead: every split takes this many tokens (a multiple
                   of ``block_n``) of its row, and a row takes as many splits as its length
                   needs (the launch: as many as the longest, ``max_seq_len``, needs). Rows
                   of very different lengths (S-HPLB's per-head budgets) then cost in
                   proportion to their tokens, where equal split counts leave the longest
                   row's programs the step's critical path; see :func:`balanced_split_tokens`.
                   Not with ``key_starts`` or ``num_splits``.
      block_n      tokens per inner iteration (power of 2, >= 16); default 64 (32 if D > 128).
      max_seq_len  host-side upper bound on ``seq_lens`` for the split heuristic; default
                   the block-table capacity ``P * S``. Not used for correctness.
      num_warps, num_stages  Triton launch options of the main kernel.

    Preconditions not checked (they would need a host sync): ``0 <= seq_lens[b] <= P * S``
    and the first ``ceil(seq_lens[b] / S)`` block-table entries are valid page ids.
    """
    B, H, Hkv, G, D, S, P = check_inputs(q, k_pages, v_pages, block_tables, seq_lens, out)
    _check_starts(key_starts, B)
    scale = resolve_scale(scale, D)
    if D > _MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} > {_MAX_HEAD_DIM} is not supported by the kernel")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if out is not None and out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")

    D_PAD = max(16, next_pow2(D))
    if block_n is None:
        block_n = 64 if D_PAD <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")

    split_blocks = 0
    max_tokens = P * S if max_seq_len is None else min(int(max_seq_len), P * S)
    if split_tokens is not None:
        if num_splits is not None or key_starts is not None:
            raise ValueError("split_tokens takes neither num_splits nor key_starts")
        if split_tokens < block_n or split_tokens % block_n:
            raise ValueError(f"split_tokens={split_tokens} must be a positive multiple of block_n={block_n}")
        split_blocks = split_tokens // block_n
        # (at least two: one split writes the output directly, and a row then must have one)
        num_splits = max(2, -(-max_tokens // split_tokens))
    if num_splits is None:
        sms = num_sms(q.device.index or 0) if q.device.type == "cuda" else 4
        num_splits = choose_num_splits(B, Hkv, max_tokens, sms)
    num_splits = int(num_splits)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")

    kmod = _load_kernels()
    interpreted = is_interpreted(kmod._paged_decode_fwd)
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors (got {q.device}); on the CPU set "
            "TRITON_INTERPRET=1 before Triton is imported, or use paged_decode_attention_ref"
        )

    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out

    if num_splits > 1:
        part_o = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel

    G_PAD = max(16, next_pow2(G))
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    kmod._paged_decode_fwd[(B * Hkv, num_splits)](
        q,
        k_pages,
        v_pages,
        block_tables,
        seq_lens,
        seq_lens if key_starts is None else key_starts.contiguous(),
        out,
        part_o,
        part_lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        v_pages.stride(0),
        v_pages.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        block_tables.stride(2),
        seq_lens.stride(0),
        seq_lens.stride(1) if seq_lens.dim() == 2 else 0,
        out.stride(0),
        out.stride(1),
        P,
        split_blocks,
        HKV=Hkv,
        G=G,
        G_PAD=G_PAD,
        D=D,
        D_PAD=D_PAD,
        PAGE_SIZE=S,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        HAS_START=key_starts is not None,
        DOT_PRECISION=dot_precision,
        INTERPRETED=interpreted,
        num_warps=_NUM_WARPS if num_warps is None else num_warps,
        num_stages=_NUM_STAGES if num_stages is None else num_stages,
    )
    if num_splits > 1:
        kmod._paged_decode_reduce[(B * H,)](
            part_o,
            part_lse,
            out,
            seq_lens,
            out.stride(0),
            out.stride(1),
            seq_lens.stride(0),
            seq_lens.stride(1) if seq_lens.dim() == 2 else 0,
            num_splits,
            split_blocks,
            H=H,
            G=G,
            D=D,
            D_PAD=D_PAD,
            SPLITS_PAD=next_pow2(num_splits),
            BLOCK_N=block_n,
            num_warps=4,
        )
    return out
