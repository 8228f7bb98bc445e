"""Select's top-k kernel alone at a decode step's shape: where its time goes.

    python benchmarks/bench_select.py --context 131072 --batch 4     # CUDA

Times ``select_ragged`` (edge masks, radix-select top-k, compaction: one program per
(request, KV head)) on random scores at Llama-3.1-8B's 8 KV heads and 32-token pages, with
uniform budgets and with S-HPLB's max-min shifted ones (the widest heads take ~8x the mean),
for several warps per program. Median of ``triton.testing.do_bench`` in microseconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048, help="mean middle tokens per head")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    e2e._import_package()
    import torch
    import triton

    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.kernels.page_select import select_ragged
    from spin_cluster.provenance import write_json

    S, hkv, B = args.page_size, 8, args.batch
    P = args.context // S
    scores = torch.randn(B, hkv, P, device="cuda")
    n = torch.full((B,), P, device="cuda")
    hplb = synthetic_maxmin_budgets(32, hkv, args.budget, S)
    rows = {"uniform": torch.full((B, hkv), args.budget // S, device="cuda"),
            "s-hplb widest layer": (-(-torch.tensor([max(hplb, key=max)], device="cuda") // S)).expand(B, -1).contiguous()}
    results = []
    for name, budgets in rows.items():
        width = 1 + int(budgets.max()) + 2
        for w in args.warps:
            us = 1e3 * triton.testing.do_bench(lambda: select_ragged(scores, n, 1, 2, budgets, width, num_warps=w),
                                               return_mode="median")
            results.append({"budgets": name, "max_budget_pages": int(budgets.max()), "warps": w, "us": us})
            print(f"| {name} | {int(budgets.max())} | {w} | {us:.1f} |", flush=True)
    out = {"context": args.context, "batch": B, "pages": P, "gpu": torch.cuda.get_device_name(), "rows": results}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "bench_select.json"), out)
    return out


if __name__ == "__main__":
    main()
