"""The GPU buffer's lookup kernel alone at decode-step shapes: what a step with misses costs.

    python benchmarks/bench_buffer_lookup.py --out DIR    # CUDA

``kernels/buffer_lookup.py`` runs one program per (request, KV head); a head with a miss walks
its whole share twice (ages, then victims), so a share as wide as the request (an elastic share
may grow to the request's every page: 4,608 columns here) costs far more per miss step than a
share of a few hundred.
Each row here is one layer's lookup at Llama-3.1-8B's 8 KV heads: B requests, shares of C
columns of which 70% hold a page, K pages selected per head of which MISS are new, a fresh
selection every call from the same shares (so misses recur). The kernel's GPU microseconds per
call (the profiler's, median over REPEATS rounds of CALLS calls; not the host's launch cost,
which a decode step's CUDA graph does not pay), for each columns-per-chunk and warps setting,
and the miss ratio the counters saw.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder)

from spin_cluster.bench.args import add_out_folder, write_result  # noqa: E402

SHAPES = [  # B, C, K: batch, share columns, selected pages per head
    (4, 4608, 540),  # 4 x 128K, elastic shares, the widest S-HPLB head
    (4, 1080, 540),  # the same head with a share of twice its selection
    (60, 1080, 540),  # 60 x 32K, S-HPLB
    (1, 4608, 540),  # one 128K request
]


def make_state(B: int, C: int, K: int, miss: float, calls: int, dev, hkv: int = 8, seed: int = 0):
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    P = max(C, 4608)
    rows = B * hkv
    perm = torch.rand(rows, P, device=dev, generator=g).argsort(-1)  # [rows, P] each head's pages, shuffled
    held_n = int(0.7 * C)
    res_page = torch.full((rows, C), -1, dtype=torch.int32, device=dev)
    res_page[:, :held_n] = perm[:, :held_n].int()
    res_slot = torch.arange(rows * C, dtype=torch.int32, device=dev).view(rows, C)
    last = 100 - torch.randint(0, 40, (rows, C), device=dev, generator=g, dtype=torch.int32)
    n_new = max(1, int(miss * K))
    wants = []
    for _ in range(calls):  # K - n_new held pages and n_new others, ascending
        pick_old = torch.rand(rows, held_n, device=dev, generator=g).argsort(-1)[:, :K - n_new]
        pick_new = held_n + torch.rand(rows, P - held_n, device=dev, generator=g).argsort(-1)[:, :n_new]
        want = torch.cat([perm.gather(1, pick_old), perm.gather(1, pick_new)], 1).sort(-1).values
        wants.append(want.view(B, hkv, K))
    shape = (B, 1, hkv, C)
    return (res_page.view(shape), res_slot.view(shape), last.view(shape), torch.arange(B, device=dev), wants, P)


def time_lookup(B, C, K, miss, chunk, warps, calls, repeats, dev) -> dict:
    import torch

    from spin_cluster.kernels.buffer_lookup import buffer_lookup, page_columns

    res_page, res_slot, last, rows, wants, P = make_state(B, C, K, miss, calls, dev)
    col = page_columns(res_page, P)
    counters = torch.zeros(4, dtype=torch.int64, device=dev)
    now = torch.full((1,), 100, dtype=torch.int32, device=dev)

    state = (res_page, last, col)
    initial = [t.clone() for t in state]

    def run(i):
        for t, t0 in zip(state, initial):  # every call from the same shares, so misses recur
            t.copy_(t0)
        buffer_lookup(res_page, res_slot, last, rows, 0, wants[i % calls], now, counters, res_col=col,
                      col_chunk=chunk, warps=warps)

    for i in range(3):  # compile, warm
        run(i)
    # The kernel's own GPU time (the profiler's, per launch): a decode step replays it from a
    # CUDA graph, so the host's launch cost (~90 us here, with 40 arguments) is not the step's.
    times = []
    counters.zero_()
    for _ in range(repeats):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                run(i)
            torch.cuda.synchronize()
        spans = [e.device_time_total for e in prof.events() if e.name == "_buffer_lookup"]
        times.append(sum(spans) / max(1, len(spans)))
    times.sort()
    lookups, hits, misses = (int(x) for x in counters[:3].tolist())
    return {"batch": B, "columns": C, "selected": K, "chunk": chunk, "warps": warps,
            "us_median": times[len(times) // 2], "us_min": times[0], "us_max": times[-1],
            "miss_ratio": misses / max(1, lookups)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--miss", type=float, default=0.1, help="fraction of each head's selection not held")
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    add_out_folder(ap)
    args = ap.parse_args(argv)
    e2e._import_package()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_buffer_lookup needs CUDA")
    dev = torch.device("cuda")
    rows = []
    print("| B | columns | selected | chunk | warps | us per layer (min-max) | miss ratio |\n|---|---:|---:|---:|---:|---:|---:|")
    for B, C, K in SHAPES:
        for chunk in args.chunks:
            for warps in args.warps:
                r = time_lookup(B, C, K, args.miss, chunk, warps, args.calls, args.repeats, dev)
                rows.append(r)
                print(f"| {B} | {C} | {K} | {chunk} | {warps} | {r['us_median']:.1f} ({r['us_min']:.1f}-"
                      f"{r['us_max']:.1f}) | {r['miss_ratio']:.3f} |", flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "miss": args.miss, "rows": rows}
    write_result(os.path.join(args.out, "bench_buffer_lookup.json"), out)
    return out


if __name__ == "__main__":
    main()
