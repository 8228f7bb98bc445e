"""Select's top-k kernel alone at a decode step's shape: where its time goes.

    python benchmarks/bench_select.py --context 131072 --batch 4     # CUDA
    python benchmarks/bench_select.py --quest 4x131072 60x32768      # Quest's Select, old vs fused

Times ``select_ragged`` (edge masks, radix-select top-k, compaction: one program per
(request, KV head)) on random scores at Llama-3.1-8B's 8 KV heads and 32-token pages, with
uniform budgets and with S-HPLB's max-min shifted ones (the widest heads take ~8x the mean),
for several warps per program, and the split-row kernel (chunks of pages per program, then
a merge per row). Median of ``triton.testing.do_bench`` in microseconds, launched and replayed
from a CUDA graph (as a decode step runs it); each row checks its pages against the whole-row
kernel's.

``--quest BxCONTEXT ...``: Quest's whole Select of a decode step (``select_layer`` over 32
layers at Llama-3.1-8B's 32 query heads, 8 KV heads, D 128, 32-token pages, a bf16 index,
sink 1 and local 2 pages as ``e2e.py`` runs them) with the separate steps (``fused=False``:
page scores, the margin, ``select_ragged``) and with ``kernels/quest_select.py``, eager and
replayed in a CUDA graph, for uniform and S-HPLB budgets, without and with the hysteresis
margin; each row checks that both give the same pages. Microseconds per step. ``--chunks``
adds the fused kernel at other chunk sizes (``quest_select(chunk=...)``), to tune
``select_chunk``.
"""

from __future__ import annotations

import argparse
import functools
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
    ap.add_argument("--quest", nargs="*", metavar="BxCONTEXT",
                    help="time Quest's Select per step, old against fused, at these shapes (e.g. 4x131072)")
    ap.add_argument("--coarse", nargs="*", default=["16:4", "16:2"], metavar="GP:FACTOR[:TILE:WARPS[:SPLIT[:GROUPS[:WARPS1]]]]",
                    help="--quest: also the two-level Select (kernels/coarse_select.py) at these groups of pages "
                         "and candidate factors (and loop tiles and warps a program; SPLIT 1: the spread launches, "
                         "TILE candidates and GROUPS groups a program, WARPS the second launch's and WARPS1 the "
                         "first's, by default half of WARPS and at least 4), timed and its recall of Quest's pages reported")
    ap.add_argument("--layers", type=int, default=32, help="--quest: layers per step")
    ap.add_argument("--chunks", type=int, nargs="*", default=[],
                    help="--quest: also time the fused Select with these pages per pass-1 program (default: select_chunk's)")
    add_out_folder(ap)
    args = ap.parse_args(argv)
    e2e._import_package()
    if args.quest is not None:
        return quest_steps(args)
    import torch
    import triton

    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.kernels.page_select import SPLIT_CHUNK, select_ragged, split_chunk

    S, hkv, B = args.page_size, 8, args.batch
    results = []
    print("| pages | budgets | max budget pages | kernel | warps | chunk | us | us in a CUDA graph | same pages |\n"
          "|---:|---|---:|---|---:|---:|---:|---:|---|")
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
            whole = select_ragged(scores, n, 1, 2, budgets, width, chunk=0)
            for kernel, w, chunk in runs:
                def call():
                    return select_ragged(scores, n, 1, 2, budgets, width, num_warps=w, chunk=chunk)
                same = all(torch.equal(a, b) for a, b in zip(call(), whole))
                us = 1e3 * triton.testing.do_bench(call, return_mode="median")
                # As a decode step runs it: replayed from a CUDA graph (no launch cost on the host).
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                graph_us = 1e3 * triton.testing.do_bench(graph.replay, return_mode="median")
                del graph
                results.append({"pages": P, "budgets": name, "max_budget_pages": int(budgets.max()),
                                "kernel": kernel, "warps": w, "chunk": chunk, "us": us, "graph_us": graph_us,
                                "same": same, "auto": split_chunk(P, width) == chunk})
                print(f"| {P} | {name} | {int(budgets.max())} | {kernel} | {w or '-'} | {chunk or '-'} | {us:.1f} | {graph_us:.1f} "
                      f"| {same} |", flush=True)
    out = {"context": args.context, "batch": B, "gpu": torch.cuda.get_device_name(), "rows": results}
    write_result(os.path.join(args.out, "bench_select.json"), out)
    return out


def quest_steps(args) -> dict:
    import torch
    import triton

    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.kernels import coarse_select as cs
    from spin_cluster.sparse import SelectPlan, get_algorithm, select_layer

    S, hkv, H, D, L = args.page_size, 8, 32, 128, args.layers
    dev = torch.device("cuda")
    hplb = torch.tensor(synthetic_maxmin_budgets(L, hkv, args.budget, S), device=dev)  # [L, Hkv] tokens
    results = []
    print("| batch x context | budgets | margin | old eager | fused eager | old graph | fused graph | same |\n"
          "|---|---|---:|---:|---:|---:|---:|---|")
    for shape in args.quest or ["4x131072", "60x32768"]:
        B, context = map(int, shape.split("x"))
        n = context // S + 8  # a few steps into decode
        P = decode_width(n)
        quest = get_algorithm("quest")(num_layers=L, num_kv_heads=hkv, head_dim=D, page_size=S, max_seqs=B,
                                       max_pages_per_seq=P, device=dev, index_dtype="bfloat16")
        g = torch.Generator(device=dev).manual_seed(0)
        for layer in range(L):  # written bounds for every page in context, the rest empty
            a = torch.randn(B, P, hkv, D, device=dev, generator=g)
            b = a + torch.rand(B, P, hkv, D, device=dev, generator=g)
            a[:, n:], b[:, n:] = float("inf"), float("-inf")
            quest.kmin[layer, :-1], quest.kmax[layer, :-1] = a.flatten(0, 1), b.flatten(0, 1)
        coarse = {}
        for spec in args.coarse:  # the same page bounds, and group bounds over them
            gp, factor, *launch = map(int, spec.split(":"))
            split = len(launch) > 2 and bool(launch[2])
            groups = launch[3] if len(launch) > 3 else cs._SPREAD_GROUPS
            warps1 = launch[4] if len(launch) > 4 else None
            launch = launch[:2]
            alg = get_algorithm("quest")(num_layers=L, num_kv_heads=hkv, head_dim=D, page_size=S, max_seqs=B,
                                         max_pages_per_seq=P, device=dev, index_dtype="bfloat16",
                                         coarse_pages=gp, coarse_factor=factor, coarse_split=split)
            if alg.kmin.shape != quest.kmin.shape:
                print(f"two-level {spec}: {P} pages a row are not whole groups; skipped")
                continue
            alg.kmin, alg.kmax = quest.kmin, quest.kmax
            nc = alg.cmin.shape[1] - 1
            alg.cmin[:, :-1] = quest.kmin[:, :-1].view(L, nc, gp, hkv, D).amin(2)
            alg.cmax[:, :-1] = quest.kmax[:, :-1].view(L, nc, gp, hkv, D).amax(2)
            # the kernel's own unless named; split: TILE is the candidates a program scores,
            # WARPS the second launch's warps (half for the first), GROUPS the groups a program
            coarse[spec] = (alg, (*(launch or ([cs._SPREAD_PAGES, cs._SPREAD_WARPS[1]] if split else
                                               [cs._TILE, cs._WARPS])), groups, warps1))
        q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        rows = torch.arange(B, device=dev)
        held = torch.rand(B, hkv, P, device=dev, generator=g) < 0.1
        budget_rows = {"uniform": torch.full((L, hkv), args.budget // S, device=dev), "s-hplb": -(-hplb // S)}
        for name, per_layer in budget_rows.items():
            plans = [SelectPlan(num_pages=torch.full((B,), n, device=dev), tail_len=torch.ones(B, dtype=torch.int32, device=dev),
                                sink_pages=1, local_pages=2, budget_pages=per_layer[i].expand(B, -1).contiguous(),
                                max_pages=P, max_budget=int(per_layer.max())) for i in range(L)]
            for margin in (0.0, 0.5):
                def step(fused):
                    return [select_layer(quest, i, q, rows, plans[i], held, margin, fused=fused) for i in range(L)]
                same = all(torch.equal(a, b) for x, y in zip(step(False), step(True)) for a, b in zip(x, y))
                row = {"batch": B, "context": context, "pages": P, "budgets": name, "margin": margin, "same": same}
                runs = {"old": lambda: step(False), "fused": lambda: step(True)}
                for chunk in args.chunks:
                    runs[f"chunk{chunk}"] = functools.partial(fused_at, quest, q, rows, plans, held, margin, chunk)
                exact = step(False)
                for spec, (alg, launch) in coarse.items():
                    runs[f"coarse{spec}"] = functools.partial(coarse_step, alg, launch, q, rows, plans, held, margin)
                    row[f"coarse{spec}_recall"] = recall(runs[f"coarse{spec}"](), exact, plans[0].sink_pages,
                                                         plans[0].local_pages, n)
                for key, fn in runs.items():
                    row[f"{key}_eager_us"] = 1e3 * triton.testing.do_bench(fn, return_mode="median")
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    row[f"{key}_graph_us"] = 1e3 * triton.testing.do_bench(graph.replay, return_mode="median")
                    del graph
                results.append(row)
                print(f"| {B} x {context} | {name} | {margin} | {row['old_eager_us']:.0f} | {row['fused_eager_us']:.0f} | "
                      f"{row['old_graph_us']:.0f} | {row['fused_graph_us']:.0f} | {same} |", flush=True)
                for chunk in args.chunks:
                    print(f"|   chunk {chunk} | | | | {row[f'chunk{chunk}_eager_us']:.0f} | | {row[f'chunk{chunk}_graph_us']:.0f} | |")
                for spec in coarse:
                    print(f"|   two-level {spec} | | | | {row[f'coarse{spec}_eager_us']:.0f} | | "
                          f"{row[f'coarse{spec}_graph_us']:.0f} | recall {row[f'coarse{spec}_recall']:.3f} |", flush=True)
        del quest, coarse
        torch.cuda.empty_cache()
    out = {"layers": L, "page_size": S, "chunks": args.chunks, "budget": args.budget, "gpu": torch.cuda.get_device_name(), "rows": results}
    write_result(os.path.join(args.out, "bench_select_quest.json"), out)
    return out


def coarse_step(alg, launch, q, rows, plans, held, margin):
    """The two-level Select of every layer, with its loop tile and warps set when given."""
    from spin_cluster.kernels import coarse_select as cs
    from spin_cluster.sparse import select_layer

    tile, warps, groups, warps1 = launch
    if alg.coarse_split:
        first = max(4, warps // 2) if warps1 is None else warps1
        cs._SPREAD_PAGES, cs._SPREAD_WARPS, cs._SPREAD_GROUPS = tile, (first, warps), groups
    else:
        cs._TILE, cs._WARPS = tile, warps
    return [select_layer(alg, i, q, rows, p, held, margin) for i, p in enumerate(plans)]


def recall(got, exact, sink, local, n) -> float:
    """Share of the exact Select's middle pages that ``got`` also selects, over every layer and
    row (random bounds have no locality: a floor for what real keys give)."""
    hit = total = 0
    for (gw, _), (ew, _) in zip(got, exact):
        mid = (ew >= sink) & (ew < n - local)
        total += int(mid.sum())
        hit += int((mid & (ew[..., :, None] == gw[..., None, :]).any(-1)).sum())
    return hit / max(1, total)


def fused_at(quest, q, rows, plans, held, margin, chunk):
    """``Quest.select_top`` over every layer, with ``chunk`` pages per pass-1 program."""
    from spin_cluster.kernels.quest_select import quest_select

    logit_scale = quest.num_kv_heads / (q.shape[1] * q.shape[2] ** 0.5)
    score_margin = margin / logit_scale
    pages = quest._score_blocks(rows, plans[0].max_pages)
    return [quest_select(q, quest.kmin[i], quest.kmax[i], pages, p.num_pages, p.sink_pages, p.local_pages,
                         p.budget_pages, p.budget_width, held if margin else None, score_margin, p.dense_rows,
                         chunk=chunk) for i, p in enumerate(plans)]


if __name__ == "__main__":
    main()
