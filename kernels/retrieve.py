"""Retrieve: copy scattered KV pages between two page pools in one launch.

Layout (per-head pages, see ``spin_cluster.kvcache.page_pool``)::

    src_k, src_v : [N_src, S, D]   e.g. the pinned host pool (every page's home)
    dst_k, dst_v : [N_dst, S, D]   e.g. the GPU slot buffer
    src_ids      : [M]             int32/int64, page to read
    dst_ids      : [M]             int32/int64, slot to write
    count        : [1] or []       optional int32/int64 device tensor, n <= M
    rows         : optional (k, v [R, D], slots [R]): write-through rows, R dividing M

For every ``i < n`` (``n = count`` if given, else ``M``) with ``src_ids[i] >= 0`` and
``dst_ids[i] >= 0``::

    dst_k[dst_ids[i]] = src_k[src_ids[i]]      dst_v[dst_ids[i]] = src_v[src_ids[i]]

then, with ``rows``, for every r with ``slots[r] >= 0`` (a flat token slot page * S + offset)::

    dst_k.view(-1, D)[slots[r]] = k[r]          dst_v.view(-1, D)[slots[r]] = v[r]

and nothing else is written. The rows land after the pages: a decode token written through
into its tail page's slot wins over that page's copy in the same launch. The pairs come in R
groups of M / R, one per row (a head's selected pages), and a row's slot lies in no other
group's destination pages, unless the rows and pages written there are alike (a CUDA graph's
padding entries share a page and write the same values); the kernel's grid:
``_retrieve_kernel.py``.

The number of misses of a decode step is computed on the GPU, so ``count`` stays there: the
launcher sizes its grid by ``M`` and programs past ``count`` do nothing. Id arrays may thus be
fixed-size buffers with stale entries past ``count`` or ``-1`` padding.

Devices. The id arrays and ``count`` live on the destination's device. On CUDA the source is
either on that device or in pinned host memory: a pinned tensor's address is valid on the GPU
(unified addressing), so the kernel reads the host tier directly over PCIe, one program per
page, with no per-page ``cudaMemcpy`` and no host round trip. On CPU-only machines both pools
are host tensors and the reference does the copy.

Two implementations with the same signature:

* the Triton kernel (CUDA destination, or CPU tensors under ``TRITON_INTERPRET=1``). Never
  syncs with the host, so it can be captured in a CUDA graph.
* :func:`retrieve_pages_ref` -- pure torch; used on the CPU path and as the test oracle. It
  selects the live pairs with a boolean mask (one host sync).

:func:`retrieve_pages` (``impl="auto"``) picks by the destination's device: the kernel for a
CUDA destination, the reference otherwise (``kernels._impl``).

Preconditions not checked (they would need a host sync): live ids are in range, and no slot
is the destination of two live pairs (which one lands is then undefined), and no page is both
read and written by one call.

This module imports only torch (and Triton, lazily) and its sibling ``offload``: it must not
import ``spin_cluster``.
"""

from __future__ import annotations


import torch

from ._impl import resolve_impl
from ._triton_support import is_interpreted, load_kernel_module, next_pow2, triton_importable
from .offload import check_also, write_tokens_ref

__all__ = ["check_rows", "pairs_per_program", "retrieve_pages", "retrieve_pages_ref", "row_args", "triton_available"]

_SUPPORTED_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
)
_ID_DTYPES = (torch.int32, torch.int64)

# Elements one program moves per chunk and tensor. 4096 bf16 = 8 KiB: a 4 KiB page (S=16,
# D=128) is one chunk, a 16 KiB page (S=64) two; with 4 warps each thread then holds two to
# four 16-byte vectors of K and as many of V in flight.
_MAX_BLOCK = 4096
_NUM_WARPS = 4
# Programs a launch aims at: past this many pairs each program takes several, one after
# another (``_retrieve_kernel.py``): enough programs stay resident to keep PCIe and HBM busy
# (16 of 4 warps per SM fill an H200), and a step whose pairs are mostly dead launches few.
_PROGRAMS = 2048
_MOST_PAIRS = 16
# Pair ids a row program checks at a time (a decode step's group is a head's selected pages).
_MAX_GROUP_BLOCK = 1024


def pairs_per_program(m: int) -> int:
    """Pairs each program copies for a launch of m pairs: a power of two, 1 up to _PROGRAMS
    pairs, at most _MOST_PAIRS."""
    p = 1
    while p < _MOST_PAIRS and m > _PROGRAMS * p:
        p *= 2
    return p


# --------------------------------------------------------------------------------------
# Input checks shared by both entry points
# --------------------------------------------------------------------------------------


def _check_pool_pair(name_k, k, name_v, v):
    """K and V pools of one tier: [N, S, D] each, same shape, dtype and device."""
    for name, t in ((name_k, k), (name_v, v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [N, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}")
        N, S, D = t.shape
        # One page must be S*D contiguous elements; pages themselves may be strided.
        if (S > 1 and t.stride(1) != D) or (D > 1 and t.stride(2) != 1):
            raise ValueError(f"each page of {name} must be contiguous, got strides {t.stride()}")
    if v.shape != k.shape:
        raise ValueError(f"{name_v} shape {tuple(v.shape)} != {name_k} shape {tuple(k.shape)}")
    if v.dtype != k.dtype:
        raise ValueError(f"{name_v} dtype {v.dtype} != {name_k} dtype {k.dtype}")
    if v.device != k.device:
        raise ValueError(f"{name_v} is on {v.device} but {name_k} is on {k.device}")


def _check_src_device(src, dev):
    """The source is on the destination's device, or (CUDA destination) pinned on the host."""
    if src.device == dev:
        return
    if dev.type == "cuda" and src.device.type == "cpu":
        if not src.is_pinned():
            raise ValueError(
                "a host source for a CUDA destination must be in pinned memory "
                "(allocate it with pin_memory=True)"
            )
        return
    raise ValueError(
        f"source pages are on {src.device}, destination on {dev}: the source must be on the "
        "destination's device or, for a CUDA destination, in pinned host memory"
    )


def _check_ids(name, ids, dev):
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be [M], got shape {tuple(ids.shape)}")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.device != dev:
        raise ValueError(f"{name} is on {ids.device} but the destination pages are on {dev}")


def _check_count(count, dev):
    if count is None:
        return
    if not isinstance(count, torch.Tensor):
        raise ValueError(
            f"count must be a 1-element device tensor or None, got {type(count).__name__}"
        )
    if count.numel() != 1:
        raise ValueError(f"count must hold one element, got shape {tuple(count.shape)}")
    if count.dtype not in _ID_DTYPES:
        raise ValueError(f"count must be int32 or int64, got {count.dtype}")
    if count.device != dev:
        raise ValueError(f"count is on {count.device} but the destination pages are on {dev}")


def check_rows(rows, dst_k, dst_v, num_pairs: int) -> None:
    """Write-through ``rows`` (k, v [R, D], slots [R]) for pages dst_k / dst_v after num_pairs
    pairs: rows in the pages' dtype, R groups of pairs."""
    if rows is None:
        return
    k, v, slots = rows
    check_also((dst_k, dst_v, slots), k, v)
    if slots.device != dst_k.device:
        raise ValueError(f"row slots are on {slots.device} but the destination pages are on {dst_k.device}")
    if num_pairs % max(k.shape[0], 1) or (num_pairs and not k.shape[0]):
        raise ValueError(f"{num_pairs} pairs do not come in groups for {k.shape[0]} rows")


def row_args(rows, dst_k, num_pairs: int) -> tuple[tuple, dict]:
    """The kernels' write-through arguments after the pairs' (k, v, slots, their row strides,
    pairs per row, R: the row programs before the pair programs) and constexprs; stand-ins
    without rows."""
    D = dst_k.shape[2]
    if rows is None:
        return (dst_k, dst_k, dst_k, 0, 0, 1, 0), dict(ROWS=False, BLOCK_D=next_pow2(D), BLOCK_G=1, GROUP_CHUNKS=0)
    k, v, slots = rows
    if k.stride(1) != 1 or v.stride(1) != 1:
        raise ValueError("k/v rows must be contiguous")
    group = num_pairs // max(k.shape[0], 1)
    block_g = min(next_pow2(group), _MAX_GROUP_BLOCK)
    return ((k, v, slots, k.stride(0), v.stride(0), group, k.shape[0]),
            dict(ROWS=True, BLOCK_D=next_pow2(D), BLOCK_G=block_g, GROUP_CHUNKS=-(-group // block_g)))


def _check_inputs(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count):
    """Validate shapes / dtypes / devices; return the number of pairs M."""
    _check_pool_pair("src_k", src_k, "src_v", src_v)
    _check_pool_pair("dst_k", dst_k, "dst_v", dst_v)
    if src_k.shape[1:] != dst_k.shape[1:]:
        raise ValueError(
            f"page shape mismatch: source pages are {tuple(src_k.shape[1:])}, "
            f"destination pages {tuple(dst_k.shape[1:])} (both [S, D])"
        )
    if src_k.dtype != dst_k.dtype:
        raise ValueError(f"source dtype {src_k.dtype} != destination dtype {dst_k.dtype}")
    dev = dst_k.device
    _check_src_device(src_k, dev)
    _check_ids("src_ids", src_ids, dev)
    _check_ids("dst_ids", dst_ids, dev)
    if src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"src_ids has {src_ids.shape[0]} entries but dst_ids has {dst_ids.shape[0]}"
        )
    _check_count(count, dev)
    return src_ids.shape[0]


# --------------------------------------------------------------------------------------
# Pure-torch reference
# --------------------------------------------------------------------------------------


def _live_pairs(src_ids, dst_ids, count):
    """Bool [M]: which pairs copy (before ``count``, both ids non-negative)."""
    live = (src_ids >= 0) & (dst_ids >= 0)
    if count is not None:
        pos = torch.arange(src_ids.shape[0], device=src_ids.device)
        live &= pos < count.reshape(())
    return live


def retrieve_pages_ref(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    count: torch.Tensor | None = None,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Pure-torch Retrieve (same contract as :func:`retrieve_pages`). Syncs with the host."""
    M = _check_inputs(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count)
    check_rows(rows, dst_k, dst_v, M)
    live = _live_pairs(src_ids, dst_ids, count)  # [M]
    src_live = src_ids[live].long()  # [n_live]
    dst_live = dst_ids[live].long()
    src_at = src_live.to(src_k.device)
    dst_k.index_copy_(0, dst_live, src_k.index_select(0, src_at).to(dst_k.device))
    dst_v.index_copy_(0, dst_live, src_v.index_select(0, src_at).to(dst_v.device))
    if rows is not None:
        write_tokens_ref(dst_k, dst_v, *rows)


# --------------------------------------------------------------------------------------
# Triton kernel launcher
# --------------------------------------------------------------------------------------


_KERNELS = ("_retrieve_kernel", "retrieve_pages", "retrieve_pages_ref")


def _load_kernel():
    return load_kernel_module(*_KERNELS)


def triton_available() -> bool:
    return triton_importable(*_KERNELS)


def retrieve_pages(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    count: torch.Tensor | None = None,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    impl: str = "auto",
) -> None:
    """Retrieve; the kernel runs one program per (src, dst) pair (several pairs each past
    2048 pairs: ``pairs_per_program``), K and V in one launch, and one per write-through row.

    See the module docstring for the contract. Keyword-only:
      block      elements per chunk and tensor (power of 2); default
                 ``min(next_pow2(S * D), 4096)``.
      num_warps  Triton launch option; default 4.
      impl       "auto", "triton" or "torch" (``kernels._impl``), by dst_k's device.
    """
    if resolve_impl(impl, dst_k.device) == "torch":
        return retrieve_pages_ref(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count, rows)
    M = _check_inputs(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count)
    check_rows(rows, dst_k, dst_v, M)
    kmod = _load_kernel()
    interpreted = is_interpreted(kmod._retrieve_pages)
    if dst_k.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"the Triton kernel needs a CUDA destination (got {dst_k.device}); on the CPU set "
            "TRITON_INTERPRET=1 before Triton is imported, or use retrieve_pages_ref"
        )
    page_numel = src_k.shape[1] * src_k.shape[2]
    if block is None:
        block = min(next_pow2(page_numel), _MAX_BLOCK)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of 2, got {block}")
    num_rows = 0 if rows is None else rows[0].shape[0]
    if (M == 0 or page_numel == 0) and not num_rows:
        return
    pairs = pairs_per_program(M)
    row_extra, row_consts = row_args(rows, dst_k, M)
    kmod._retrieve_pages[(num_rows + -(-M // pairs),)](
        src_k,
        src_v,
        dst_k,
        dst_v,
        src_ids,
        dst_ids,
        src_ids if count is None else count,  # unused without a count
        M,
        src_k.stride(0),
        src_v.stride(0),
        dst_k.stride(0),
        dst_v.stride(0),
        *row_extra,
        PAGE_NUMEL=page_numel,
        S=src_k.shape[1],
        D=src_k.shape[2],
        BLOCK=block,
        NUM_CHUNKS=-(-page_numel // block),
        HAS_COUNT=count is not None,
        PAIRS=pairs,
        **row_consts,
        num_warps=_NUM_WARPS if num_warps is None else num_warps,
    )
