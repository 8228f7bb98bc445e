"""Select's top-k kernel alone at a decode step's shape: where its time goes.

    python benchmarks/bench_select.py --context 131072 --batch 4     # CUDA

Times ``select_ragged`` (edge masks, radix-select top-k, compaction: one program per
(request, KV head)) on random scores at Llama-3.1-8B's 8 KV heads and 32-token pages, with
uniform budgets and with S-HPLB's max-min shifted ones (the widest heads take ~8x the mean),
for several warps per program, and the split-row kernel (chunks of pages per program, then
a merge per row). Median of ``triton.testing.do_bench`` in microseconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder)

from spin_cluster.bench.args import add_budget_tokens, add_out_folder, write_result  # noqa: E402


def decode_width(pages: int) -> int:
    """``SpinAttention.decode_pages``' rounding: up to an eighth of the page count's power of two."""
    grain = max(16, (1 << max(0, (pages - 1).bit_length())) // 8)
    return -(-pages // grain) * grain


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=4)
    add_budget_tokens(ap)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    add_out_folder(ap)
    args = ap.parse_args(argv)
    e2e._import_package()
    import torch
    import triton

    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.kernels.page_select import SPLIT_CHUNK, select_ragged, split_chunk

    S, hkv, B = args.page_size, 8, args.batch
    results = []
    print("| pages | budgets | max budget pages | kernel | warps | us |\n|---:|---|---:|---|---:|---:|")
    # The context's own page count, and a decode step's Select width past it (an eighth of a
    # power of two more: 128K tokens + 256 generated = 4104 pages, scored as 5120).
    for P in sorted({args.context // S, decode_width(args.context // S + 8)}):
        scores = torch.randn(B, hkv, P, device="cuda")
        n = torch.full((B,), min(P, args.context // S + 8), device="cuda")
        hplb = synthetic_maxmin_budgets(32, hkv, args.budget, S)
        rows = {"uniform": torch.full((B, hkv), args.budget // S, device="cuda"),
                "s-hplb widest layer": (-(-torch.tensor([max(hplb, key=max)], device="cuda") // S)).expand(B, -1).contiguous()}
        for name, budgets in rows.items():
            width = 1 + int(budgets.max()) + 2
            runs = [("whole row", w, 0) for w in args.warps] + [("split rows", 0, SPLIT_CHUNK)]
            for kernel, w, chunk in runs:
                def call():
                    return select_ragged(scores, n, 1, 2, budgets, width, num_warps=w, chunk=chunk)
                us = 1e3 * triton.testing.do_bench(call, return_mode="median")
                results.append({"pages": P, "budgets": name, "max_budget_pages": int(budgets.max()),
                                "kernel": kernel, "warps": w, "chunk": chunk, "us": us,
                                "auto": split_chunk(P, width) == chunk})
                print(f"| {P} | {name} | {int(budgets.max())} | {kernel} | {w or '-'} | {us:.1f} |", flush=True)
    out = {"context": args.context, "batch": B, "gpu": torch.cuda.get_device_name(), "rows": results}
    write_result(os.path.join(args.out, "bench_select.json"), out)
    return out


if __name__ == "__main__":
    main()
