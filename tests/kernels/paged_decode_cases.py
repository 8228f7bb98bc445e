"""Shared cases of the paged decode attention tests: a random paged cache with shuffled page
ids and garbage table padding, a float64 oracle, and tolerances by dtype."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# Kernel vs reference, and reference vs float64 oracle, by dtype: (atol, rtol).
KERNEL_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
REF_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}

PAD_GARBAGE = 1 << 30  # block-table padding: far out of range, so any read of it would fail


def make_case(
    seq_lens,
    *,
    num_kv_heads=2,
    group=2,
    head_dim=32,
    page_size=16,
    dtype=torch.float32,
    extra_pages=5,
    max_pages=None,
    seed=0,
    device=DEVICE,
):
    """Random paged cache with shuffled physical page ids and garbage block-table padding."""
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, D, S = len(seq_lens), num_kv_heads, head_dim, page_size
    H = Hkv * group
    pages_needed = [-(-n // S) for n in seq_lens]
    P = max_pages if max_pages is not None else max(1, max(pages_needed))
    n_used = sum(pages_needed) * Hkv
    N = n_used + extra_pages
    k_pages = torch.randn(N, S, D, generator=gen).to(dtype)
    v_pages = torch.randn(N, S, D, generator=gen).to(dtype)
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    perm = torch.randperm(N, generator=gen).tolist()
    block_tables = torch.full((B, Hkv, P), PAD_GARBAGE, dtype=torch.int32)
    it = iter(perm)
    for b in range(B):
        for h in range(Hkv):
            for p in range(pages_needed[b]):
                block_tables[b, h, p] = next(it)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_pages, v_pages, block_tables, seq_lens_t)]


def dense_oracle(q, k_pages, v_pages, block_tables, seq_lens, scale=None, key_starts=None):
    """Straightforward float64 attention: gather each request's K/V (from ``key_starts[b]`` on,
    if given), plain softmax."""
    B, H, D = q.shape
    S = k_pages.shape[1]
    Hkv = block_tables.shape[1]
    G = H // Hkv
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(B, H, D, dtype=torch.float64)
    q, k_pages, v_pages = (t.cpu().double() for t in (q, k_pages, v_pages))
    block_tables, seq_lens = block_tables.cpu(), seq_lens.cpu()
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        n_pages = -(-n // S)
        for h in range(H):
            pages = block_tables[b, h // G, :n_pages].long()
            first = 0 if key_starts is None else int(key_starts[b])
            k = k_pages[pages].reshape(-1, D)[first:n]
            v = v_pages[pages].reshape(-1, D)[first:n]
            w = torch.softmax((k @ q[b, h]) * scale, dim=0)
            out[b, h] = w @ v
    return out


def assert_close(actual, expected, tol):
    atol, rtol = tol
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=atol, rtol=rtol)


# Ragged lengths: a single token, exactly one page, exact page boundaries, partial last pages.
RAGGED_16 = [1, 16, 37, 64, 5]
