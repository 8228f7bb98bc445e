"""FP8 host pages: half the host bytes and half the PCIe bytes of a miss.

Host pages may hold K and V as FP8 (e4m3) with one float32 scale per token and page row,
so that a row's largest magnitude maps to e4m3's largest finite value (448)::

    pages   [N, S, D] float8_e4m3fn     q = round_e4m3(x / scale)
    scales  [N, S]    float32           scale = max(|x|) / 448  (1 where the row is all zero)

    write_tokens_fp8(dst_k, dst_v, dst_k_scale, dst_v_scale, k, v, slots)
        k, v [M, D] rows (any float dtype) -> quantised into flat token slots [M] of the
        pages (page * S + offset; < 0 skips the row), their scales beside them
    retrieve_pages_fp8(src_k, src_v, src_k_scale, src_v_scale, dst_k, dst_v, src_ids, dst_ids, rows)
        FP8 pages src_ids [M] -> dequantised into pages dst_ids [M] of dst_k / dst_v [N', S, D]
        (the model's dtype); pairs with a negative id move nothing; then the optional
        write-through rows (k, v [R, D], slots [R]) unquantised, over their pages' copies
        (``retrieve.py``'s contract)

A per-token scale costs 4 bytes per 128-element row (3%) and keeps a row's relative error
at e4m3's (at most 2^-4 of the row's largest value), where one scale per page lets one
outlier token flatten its page's other rows. Each has a Triton kernel (one program per row,
or per page pair; the source may be pinned host memory read through unified addressing)
and a torch reference of the same signature; ``impl="auto"`` picks as every launcher does
(``kernels._impl``). This module imports only torch (and Triton, lazily).
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import load_kernel_module, next_pow2
from .offload import check_also, write_tokens_ref
from .retrieve import check_rows, pairs_per_program, row_args

__all__ = ["FP8_DTYPE", "FP8_MAX", "retrieve_pages_fp8", "retrieve_pages_fp8_ref", "write_tokens_fp8",
           "write_tokens_fp8_ref"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value


def _check_pages(k, v, ks, vs, what: str) -> None:
    if k.dtype != FP8_DTYPE or v.dtype != FP8_DTYPE:
        raise ValueError(f"{what} pages must be {FP8_DTYPE}, got {k.dtype} / {v.dtype}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{what} pages must both be [N, S, D], got {tuple(k.shape)} / {tuple(v.shape)}")
    if ks.shape != k.shape[:2] or vs.shape != k.shape[:2] or ks.dtype != torch.float32 or vs.dtype != torch.float32:
        raise ValueError(f"{what} scales must be float32 [N, S] = {tuple(k.shape[:2])}")
    if not all(t.is_contiguous() for t in (k, v, ks, vs)):
        raise ValueError(f"{what} pages and scales must be contiguous")


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    """[M, D] -> [M] float32 scales: max |x| / 448, 1 for an all-zero row."""
    amax = x.float().abs().amax(-1)
    return torch.where(amax > 0, amax / FP8_MAX, 1.0)


def write_tokens_fp8_ref(dst_k, dst_v, dst_k_scale, dst_v_scale, k, v, slots, also=None) -> None:
    _check_pages(dst_k, dst_v, dst_k_scale, dst_v_scale, "destination")
    if also is not None:
        write_tokens_ref(*also[:2], k, v, also[2])
    D = dst_k.shape[2]
    keep = slots >= 0
    idx = slots[keep].long().to(dst_k.device)
    for x, pages, scales in ((k, dst_k, dst_k_scale), (v, dst_v, dst_v_scale)):
        rows = x[keep].float()
        scale = _row_scale(rows)
        q = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        # index_copy_ has no float8 kernel on every build: copy the bytes.
        pages.view(torch.uint8).view(-1, D).index_copy_(0, idx, q.view(torch.uint8).to(pages.device))
        scales.view(-1).index_copy_(0, idx, scale.to(scales.device))


def retrieve_pages_fp8_ref(src_k, src_v, src_k_scale, src_v_scale, dst_k, dst_v, src_ids, dst_ids, rows=None) -> None:
    _check_pages(src_k, src_v, src_k_scale, src_v_scale, "source")
    check_rows(rows, dst_k, dst_v, src_ids.shape[0])
    live = (src_ids >= 0) & (dst_ids >= 0)
    src = src_ids[live].long().to(src_k.device)
    dst = dst_ids[live].long().to(dst_k.device)
    for pages, scales, out in ((src_k, src_k_scale, dst_k), (src_v, src_v_scale, dst_v)):
        q = pages.view(torch.uint8).index_select(0, src).view(FP8_DTYPE).float()  # [n, S, D]
        x = q * scales.index_select(0, src)[..., None]
        out.index_copy_(0, dst, x.to(out.dtype).to(out.device))
    if rows is not None:
        write_tokens_ref(dst_k, dst_v, *rows)


def _kernels():
    kmod = load_kernel_module("_fp8_pages_kernel", "the FP8 host page kernels", "write_tokens_fp8_ref / retrieve_pages_fp8_ref")
    return kmod._write_tokens_fp8, kmod._retrieve_pages_fp8


def write_tokens_fp8(dst_k, dst_v, dst_k_scale, dst_v_scale, k, v, slots, also=None, *, impl: str = "auto") -> None:
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``), decided by k's device.
    ``also`` (``offload.check_also``): the same rows, unquantised, to a second destination
    (the GPU home pages) in the same launch."""
    if resolve_impl(impl, k.device) == "torch":
        return write_tokens_fp8_ref(dst_k, dst_v, dst_k_scale, dst_v_scale, k, v, slots, also)
    _check_pages(dst_k, dst_v, dst_k_scale, dst_v_scale, "destination")
    D = dst_k.shape[2]
    if k.dim() != 2 or k.shape != v.shape or k.shape[1] != D or slots.shape != (k.shape[0],):
        raise ValueError(f"k/v must be [M, {D}] and slots [M]")
    if also is not None:
        check_also(also, k, v)
    if k.shape[0] == 0:
        return
    if k.stride(1) != 1 or v.stride(1) != 1:
        raise ValueError("k/v rows must be contiguous")
    write, _ = _kernels()
    ak, av, also_slots = also if also is not None else (k, v, slots)
    write[(k.shape[0],)](dst_k.view(torch.uint8), dst_v.view(torch.uint8), dst_k_scale, dst_v_scale, k, v, slots,
                         k.stride(0), v.stride(0), ak, av, also_slots, D=D, BLOCK_D=next_pow2(D), ALSO=also is not None)


def retrieve_pages_fp8(src_k, src_v, src_k_scale, src_v_scale, dst_k, dst_v, src_ids, dst_ids, rows=None, *,
                       impl: str = "auto") -> None:
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``), decided by dst_k's device."""
    if resolve_impl(impl, dst_k.device) == "torch":
        return retrieve_pages_fp8_ref(src_k, src_v, src_k_scale, src_v_scale, dst_k, dst_v, src_ids, dst_ids, rows)
    _check_pages(src_k, src_v, src_k_scale, src_v_scale, "source")
    if dst_k.shape[1:] != src_k.shape[1:] or dst_v.shape != dst_k.shape or not dst_k.is_contiguous():
        raise ValueError("destination pages must be contiguous [N', S, D] like the source's")
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError("src_ids and dst_ids must be [M] alike")
    M = src_ids.shape[0]
    check_rows(rows, dst_k, dst_v, M)
    num_rows = 0 if rows is None else rows[0].shape[0]
    if M == 0 and not num_rows:
        return
    _, retrieve = _kernels()
    S, D = src_k.shape[1:]
    pairs = pairs_per_program(M)
    row_extra, row_consts = row_args(rows, dst_k, M)
    retrieve[(num_rows + -(-M // pairs),)](src_k.view(torch.uint8), src_v.view(torch.uint8), src_k_scale,
                                           src_v_scale, dst_k, dst_v, src_ids, dst_ids, M, *row_extra, S=S, D=D,
                                           BLOCK_S=next_pow2(S), PAIRS=pairs, **row_consts)
