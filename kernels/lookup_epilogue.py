"""What a decode layer needs after the buffer lookup, in one launch instead of ~25 operators:

    src, lens, tail_slot = lookup_epilogue(want, slots, miss, num_selected, rows, tail_len,
                                           directory, layer, segment_pages, page_size)

    want          [B, Hkv, K] int   selected logical pages, -1 padding, ascending (tail last)
    slots         [B, Hkv, K] int32 their buffer slots (the lookup's)
    miss          [B, Hkv, K] bool  which must be retrieved (the lookup's)
    num_selected  [B, Hkv] int      valid entries per head (>= 1: the tail page)
    rows          [B] int64; tail_len [B] int (tokens in each request's tail page, 1..S)
    directory     [R, L, Hkv, n_seg] int32 host segment ids (``kvcache.directory``)
    returns  src [B*Hkv*K] int64   host page of each miss (Retrieve's sources), -1 elsewhere
             lens [B, Hkv] int32   tokens each head attends: (num_selected - 1) * S + tail_len
             tail_slot [B*Hkv] int64  flat buffer slot of each head's newest token (the
                                      write-through): slot of the last selected page * S + tail_len - 1

Two implementations with the same contract: the Triton kernel (one program per (request,
head); CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and ``lookup_epilogue_ref``
(torch); ``lookup_epilogue(..., impl="auto")`` picks one (``kernels._impl``). Neither syncs
with the host.
"""

from __future__ import annotations

import torch

from ._impl import resolve_impl
from ._triton_support import is_interpreted, load_kernel_module, next_pow2

__all__ = ["lookup_epilogue", "lookup_epilogue_ref"]


def _check(want, slots, miss, num_selected, rows, tail_len, directory):
    B, H, K = want.shape
    if slots.shape != want.shape or miss.shape != want.shape:
        raise ValueError(f"want, slots and miss must have one shape; got {tuple(want.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(miss.shape)}")
    if tuple(num_selected.shape) != (B, H) or tuple(rows.shape) != (B,) or tuple(tail_len.shape) != (B,):
        raise ValueError("num_selected must be [B, Hkv], rows and tail_len [B]")
    if directory.dim() != 4 or directory.shape[2] != H:
        raise ValueError(f"directory must be [R, L, {H}, n_seg], got {tuple(directory.shape)}")


def lookup_epilogue_ref(want, slots, miss, num_selected, rows, tail_len, directory, layer: int,
                        segment_pages: int, page_size: int):
    _check(want, slots, miss, num_selected, rows, tail_len, directory)
    E, S = segment_pages, page_size
    safe = want.clamp(min=0).long()
    seg = directory[rows, layer].gather(2, safe // E).long()  # [B, Hkv, K]
    src = torch.where(miss & (want >= 0), seg * E + safe % E, -1).view(-1)
    tail = tail_len.long()[:, None]  # [B, 1]
    last = slots.gather(-1, (num_selected.long() - 1).clamp(min=0)[..., None])[..., 0].long()  # [B, Hkv]
    lens = ((num_selected.long() - 1) * S + tail).to(torch.int32)
    return src, lens, (last * S + tail - 1).reshape(-1)


def lookup_epilogue(want, slots, miss, num_selected, rows, tail_len, directory, layer: int,
                    segment_pages: int, page_size: int, *, impl: str = "auto"):
    """``impl``: "auto", "triton" or "torch" (``kernels._impl``)."""
    if resolve_impl(impl, want.device) == "torch":
        return lookup_epilogue_ref(want, slots, miss, num_selected, rows, tail_len, directory, layer,
                                   segment_pages, page_size)
    _check(want, slots, miss, num_selected, rows, tail_len, directory)
    kmod = load_kernel_module("_lookup_epilogue_kernel", "lookup_epilogue", "lookup_epilogue_ref")
    if want.device.type != "cuda" and not is_interpreted(kmod._lookup_epilogue):
        raise ValueError("the Triton lookup epilogue needs CUDA tensors (or TRITON_INTERPRET=1); use lookup_epilogue_ref")
    if directory.stride(3) != 1:
        raise ValueError("directory must be contiguous in its last dimension")
    B, H, K = want.shape
    dev = want.device
    src = torch.empty(B * H * K, dtype=torch.int64, device=dev)
    lens = torch.empty(B, H, dtype=torch.int32, device=dev)
    tail_slot = torch.empty(B * H, dtype=torch.int64, device=dev)
    if B * H:
        kmod._lookup_epilogue[(B * H,)](
            want.contiguous(), slots.contiguous(), miss.contiguous(), num_selected.contiguous(), rows.contiguous(),
            tail_len.contiguous(), directory, src, lens, tail_slot,
            int(layer), directory.stride(0), directory.stride(1), directory.stride(2), K, H,
            SEGMENT_PAGES=segment_pages, PAGE_SIZE=page_size, K_PAD=max(16, next_pow2(K)), num_warps=4,
        )
    return src, lens, tail_slot
