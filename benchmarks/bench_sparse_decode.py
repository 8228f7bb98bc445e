"""Sparse decode attention vs dense SDPA decode at long context on a GPU (not a test).

    python benchmarks/bench_sparse_decode.py [--batches 1 16] [--context 131072] [--budget 2048]
                                             [--algorithm quest|labels] [--out results.json]

One decode step of one layer at Llama-3.1-8B attention shapes (H=32, Hkv=8, D=128, bf16,
page size 16), every request holding ``--context`` tokens, pages already resident on the GPU
(scattered: each (request, KV head) visits its pages in shuffled order). Timed, same run:

* ``dense``      torch SDPA over the contiguous [B, Hkv, T, D] cache (the G query heads of a
                 KV head as a length-G query, exact for decode): what a dense engine reads.
* ``paged``      our Triton paged decode kernel over every page (flash-decoding splits): the
                 stronger dense baseline.
* ``sparse``     the engine's decode path without the buffer: the Select's ``score`` (Quest's
                 page bounds, or ``labels``' best key of each page over its D/4
                 strongest channels; Triton), ``select_pages`` (sink + local + ragged per-head top-k,
                 Triton), the gather of selected pages' physical ids, and the Triton paged
                 decode kernel over the selected tokens with per-head lengths.
                 ``select`` = score + top-k + gather, ``attention`` = the decode kernel.

Each part is timed in a CUDA graph (no Python launch cost, as the engine's decode graphs
run it) and with plain launches. The index is timed in float32 (the default) and in
bfloat16 (``sparse.options: {index_dtype: bfloat16}``). The HBM copy bandwidth of the same
GPU is measured in the same run, and the attention part's bandwidth is given against it.
"""

from __future__ import annotations

import argparse
import sys

from spin_cluster.bench.args import add_algorithm, add_budget_tokens, add_out, add_shape, save

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=131072)
    add_budget_tokens(ap, help="middle tokens per KV head")
    add_algorithm(ap, help="the Select to time")
    ap.add_argument("--sink-tokens", type=int, default=16)
    ap.add_argument("--local-tokens", type=int, default=64)
    ap.add_argument("--index-dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16", "float8_e4m3fn"],
                    help="the index dtypes timed (float8_e4m3fn: labels only)")
    ap.add_argument("--channels", type=float, default=0,
                    help="labels: sparse.options.channels (r, or a fraction of D under 1; 0: D/4)")
    ap.add_argument("--label-tiles", type=int, nargs="*", default=[],
                    help="labels: also time the scorer alone at these label values a program "
                         "(kernels.page_select.label_scores' tile_values; the default 8192 is timed anyway), "
                         "a decode step's label write, one launch against the four torch ops, and its query's "
                         "label channels, one launch against the sum and the gather")
    add_shape(ap, page_size=16)
    add_out(ap)
    args = ap.parse_args()
    from spin_cluster.sparse import SelectPlan, get_algorithm, select_pages

    taken = get_algorithm(args.algorithm).index_dtypes  # the algorithm's own list (an 8-bit float: labels only)
    if not set(args.index_dtypes) <= set(taken):
        ap.error(f"--index-dtypes: {args.algorithm} takes {', '.join(taken)}")

    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing

    if not torch.cuda.is_available():
        sys.exit("bench_sparse_decode needs a CUDA GPU")
    from spin_cluster.kernels.paged_decode import paged_decode_attention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    H, Hkv, D, S = args.heads, args.kv_heads, args.head_dim, args.page_size
    G, T = H // Hkv, args.context
    if T % S:
        sys.exit(f"--context {T} must be a multiple of the page size {S}")
    P = T // S
    sink_p, local_p, budget_p = -(-args.sink_tokens // S), -(-args.local_tokens // S), args.budget // S
    props = torch.cuda.get_device_properties(dev)
    head = (f"{props.name} | torch {torch.__version__}, triton {triton.__version__} | H={H} Hkv={Hkv} "
            f"D={D} S={S} bf16 | {args.algorithm} | context {T} | budget {args.budget} + sink {args.sink_tokens} + "
            f"local {args.local_tokens} tokens per KV head")
    print(head, flush=True)

    def graph_us(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3

    def plain_us(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3

    # HBM copy bandwidth (read + write) on 4 GiB.
    src = torch.empty(2 << 30, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * src.element_size() / (plain_us(lambda: dst.copy_(src)) * 1e-6) / 1e9
    del src, dst
    print(f"HBM copy bandwidth: {copy_gbs:.0f} GB/s (read + write)", flush=True)

    results = {"algorithm": args.algorithm, "gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
               "context": T, "budget_tokens": args.budget, "sink_tokens": args.sink_tokens,
               "local_tokens": args.local_tokens, "heads": H, "kv_heads": Hkv, "head_dim": D,
               "page_size": S, "copy_gbs": copy_gbs, "rows": []}
    hdr = (f"{'B':>3} {'index':>8} | {'dense us':>9} {'paged us':>9} | {'score us':>8} {'top-k us':>8} {'select us':>9} "
           f"{'attn us':>8} {'total us':>9} "
           f"{'plain us':>9} | {'speedup':>7} {'vs paged':>8} {'sel %':>6} {'attn GB/s':>9} {'% copy':>6}")
    print(hdr)
    print("-" * len(hdr))
    for B in args.batches:
        k_dense = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
        v_dense = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
        q = torch.randn(B, H, D, device=dev, dtype=dtype)
        q_sdpa = q.view(B, Hkv, G, D)
        t_dense = graph_us(lambda: F.scaled_dot_product_attention(q_sdpa, k_dense, v_dense))

        # The same tokens as scattered pages: (b, h, p) lives in physical page phys[b, h, p].
        k_pages = k_dense.view(B * Hkv * P, S, D)
        v_pages = v_dense.view(B * Hkv * P, S, D)
        base = torch.arange(B * Hkv, device=dev).view(B, Hkv, 1) * P
        perm = torch.argsort(torch.rand(B, Hkv, P, device=dev), dim=-1)
        phys = base + perm  # [B, Hkv, P] physical page of each logical page
        extra = {"channels": args.channels} if args.algorithm == "labels" else {}
        alg = get_algorithm(args.algorithm)(num_layers=1, num_kv_heads=Hkv, head_dim=D, page_size=S,
                                            max_seqs=B, max_pages_per_seq=P, device=dev, **extra)
        for b in range(B):  # the index the engine's Index step would have built
            if args.algorithm == "quest":
                pages_k = k_pages[phys[b]]  # [Hkv, P, S, D]
                alg.kmin[0, b * P:(b + 1) * P] = pages_k.amin(2).transpose(0, 1).float()
                alg.kmax[0, b * P:(b + 1) * P] = pages_k.amax(2).transpose(0, 1).float()
                del pages_k
            else:
                alg.on_append(0, torch.full((T,), b, device=dev), torch.arange(T, device=dev),
                              k_dense[b].transpose(0, 1))
        rows = torch.arange(B, device=dev)
        plan = SelectPlan(
            num_pages=torch.full((B,), P, device=dev, dtype=torch.int64),
            tail_len=torch.full((B,), S, device=dev, dtype=torch.int32),
            sink_pages=sink_p, local_pages=local_p,
            budget_pages=torch.full((B, Hkv), budget_p, device=dev, dtype=torch.int64),
            max_pages=P, max_budget=budget_p)
        out = torch.empty_like(q)
        # Our dense path for reference: the same Triton decode kernel over every page.
        all_lens = torch.full((B,), T, device=dev, dtype=torch.int32)
        all_tables = phys.to(torch.int32)
        t_dense_paged = graph_us(lambda: paged_decode_attention(q, k_pages, v_pages, all_tables, all_lens, out=out))
        sel: dict = {}

        def select():
            scores = alg.score(0, q, rows, P)
            want, num_selected = select_pages(scores, False, plan, Hkv)
            sel["tables"] = phys.gather(-1, want.clamp(min=0)).to(torch.int32)
            sel["lens"] = ((num_selected - 1) * S + plan.tail_len[:, None]).to(torch.int32)

        def attend():
            paged_decode_attention(q, k_pages, v_pages, sel["tables"], sel["lens"], out=out)

        def step():
            select()
            attend()

        for index_dtype in [getattr(torch, name) for name in args.index_dtypes]:
            if args.algorithm == "quest":
                alg.kmin, alg.kmax = alg.kmin.to(index_dtype), alg.kmax.to(index_dtype)
            else:
                alg.labels = alg.labels.to(index_dtype)
            select()
            attend()
            torch.cuda.synchronize()
            tokens = sel["lens"].sum().item()  # selected tokens over all (request, KV head)
            t_sel, t_attn, t_total, t_plain = graph_us(select), graph_us(attend), graph_us(step), plain_us(step)
            scores = alg.score(0, q, rows, P)
            t_score = graph_us(lambda: alg.score(0, q, rows, P))
            t_topk = graph_us(lambda: select_pages(scores, False, plan, Hkv))
            tiles = {}
            if args.algorithm == "labels" and args.label_tiles:
                from spin_cluster.kernels.page_select import LABEL_TILE_VALUES, label_append, label_query, label_scores

                qr = alg.query_labels(0, q)
                for tile in sorted({*args.label_tiles, LABEL_TILE_VALUES}):
                    tiles[tile] = graph_us(lambda: label_scores(qr, alg.labels[0], rows, alg.lengths, alg.span, P, S,
                                                                tile_values=tile))
                k_new = torch.randn(B, 3 * Hkv, D, device=dev, dtype=dtype)[:, Hkv:2 * Hkv]  # a fused QKV's K
                slots = rows * alg.span + T - 1
                for impl in ("torch", "triton"):
                    tiles[f"append_{impl}"] = graph_us(lambda: label_append(alg.labels[0], k_new, alg.channel_ids[0],
                                                                            slots, impl=impl))
                    tiles[f"query_{impl}"] = graph_us(lambda: label_query(q, alg.channel_ids[0], impl=impl))
                print("   label scorer us by tile values: " + ", ".join(f"{t}: {u:.1f}" for t, u in tiles.items()),
                      flush=True)
            attn_gbs = 2 * tokens * D * k_dense.element_size() / (t_attn * 1e-6) / 1e9
            row = {"batch": B, "index_dtype": str(index_dtype).removeprefix("torch."),
                   "channels": getattr(alg, "channels", None),
                   "dense_us": t_dense, "dense_paged_us": t_dense_paged, "score_us": t_score, "topk_us": t_topk, "select_us": t_sel, "attention_us": t_attn, "total_us": t_total,
                   "total_plain_us": t_plain, "speedup": t_dense / t_total,
                   "speedup_vs_paged": t_dense_paged / t_total,
                   "select_share": t_sel / (t_sel + t_attn), "attention_gbs": attn_gbs, "label_tiles_us": tiles,
                   "attention_of_copy": attn_gbs / copy_gbs, "selected_tokens_per_head": tokens / (B * Hkv)}
            results["rows"].append(row)
            print(f"{B:>3} {row['index_dtype']:>8} | {t_dense:9.1f} {t_dense_paged:9.1f} | {t_score:8.1f} {t_topk:8.1f} {t_sel:9.1f} "
                  f"{t_attn:8.1f} {t_total:9.1f} "
                  f"{t_plain:9.1f} | {row['speedup']:6.1f}x {row['speedup_vs_paged']:6.1f}x {100 * row['select_share']:5.1f}% "
                  f"{attn_gbs:9.0f} {100 * row['attention_of_copy']:5.0f}%", flush=True)
        del k_dense, v_dense, k_pages, v_pages, alg, sel
        torch.cuda.empty_cache()
    save(args, results)


if __name__ == "__main__":
    main()
