"""Benchmark paged decode attention on a GPU (not a test).

    python benchmarks/bench_paged_decode.py [--batches 1 32] [--contexts 8192 32768 131072]
                                            [--contiguous-pages] [--no-ref] [--sweep] [--out JSON]

For each batch size B and context length T (every request holds T tokens), with
H=32, Hkv=8, D=128, page size 16, bf16, times with ``triton.testing.do_bench`` (median):

* ``kernel``     -- the Triton paged kernel (default split heuristic), plain launches
* ``kernel/cg``  -- the same inside a CUDA graph (no Python launch overhead)
* ``ref``        -- the pure-torch reference (gathers pages, fp32 softmax)
* ``sdpa``       -- torch SDPA over the same cache viewed as contiguous [B, Hkv, T, D]
                   (GQA as a length-G query per KV head, which is exact for decode)

and reports effective bandwidth = K+V bytes read / time. The paged pool is the dense cache
viewed as [B*Hkv*T/16, 16, D] pages; by default each (request, KV head)'s block table
visits its pages in shuffled order (scattered pages, as in a long-running server; attention is
order-free over keys so the output still equals SDPA's), with ``--contiguous-pages`` in order.
``kernel/cg`` (CUDA graph replay) does not flush L2 between runs; ``do_bench`` does.
``--sweep`` times the kernel over block_n / num_warps / num_stages / num_splits instead.
``--per-head-budget TOKENS`` times Spin's rows instead: each KV head attends its own number of
tokens, a layer's S-HPLB budget (``synthetic_maxmin_budgets``, the e2e benchmark's: TOKENS a
head on average) plus 80 sink and local tokens, for every layer of ``--layers``, with the
split count of ``choose_num_splits`` (every row cut in as many slices) against balanced
splits (``split_tokens``: equal slices, a row as many as it needs); us per layer and per
step (every layer), in CUDA graphs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout without the package installed: last, after an installed one
    sys.path.append(_ROOT)
from spin_cluster.bench.args import add_out, add_shape, save  # noqa: E402


def _import_paged_decode():
    """``spin_cluster.kernels.paged_decode``, also from a source checkout not pip-installed
    (where the top-level ``kernels/`` folder is that package)."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    try:
        import spin_cluster.kernels.paged_decode as mod

        return mod
    except ImportError:
        pass
    import spin_cluster

    pkg_dir = os.path.join(_ROOT, "kernels")
    spec = importlib.util.spec_from_file_location(
        "spin_cluster.kernels",
        os.path.join(pkg_dir, "__init__.py"),
        submodule_search_locations=[pkg_dir],
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["spin_cluster.kernels"] = pkg
    spec.loader.exec_module(pkg)
    spin_cluster.kernels = pkg
    import spin_cluster.kernels.paged_decode as mod

    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    add_shape(ap, page_size=16)
    ap.add_argument("--contiguous-pages", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) torch reference")
    ap.add_argument("--num-splits", type=int, default=None, help="override the heuristic")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the table, time the kernel (in a CUDA graph) over block_n x num_warps "
        "x num_stages x num_splits for each (B, ctx) and print the best settings",
    )
    ap.add_argument("--per-head-budget", type=int, default=0,
                    help="time per-head lengths from S-HPLB budgets of this mean (tokens a head) instead")
    ap.add_argument("--layers", type=int, default=32, help="--per-head-budget: the budgets' layers")
    add_out(ap, help="write the table's rows (or the sweep's best settings) as JSON here")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    import triton.testing

    if not torch.cuda.is_available():
        sys.exit("bench_paged_decode needs a CUDA GPU")
    pd = _import_paged_decode()

    torch.manual_seed(0)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    H, Hkv, D, S = args.heads, args.kv_heads, args.head_dim, args.page_size
    G = H // Hkv
    props = torch.cuda.get_device_properties(dev)
    print(
        f"{props.name}, {props.multi_processor_count} SMs | torch {torch.__version__}, "
        f"triton {triton.__version__} | H={H} Hkv={Hkv} D={D} S={S} {dtype} | "
        f"pages {'contiguous' if args.contiguous_pages else 'shuffled'}"
    )
    hdr = (
        f"{'B':>3} {'ctx':>7} {'splits':>6} | {'kernel us':>9} {'GB/s':>6} | "
        f"{'kern/cg us':>10} {'GB/s':>6} | {'ref us':>9} {'GB/s':>6} | "
        f"{'sdpa us':>9} {'GB/s':>6} | {'max|k-ref|':>10} {'max|k-sdpa|':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    result = {"gpu": props.name, "sms": props.multi_processor_count, "heads": H, "kv_heads": Hkv, "head_dim": D,
              "page_size": S, "dtype": "bfloat16", "pages": "contiguous" if args.contiguous_pages else "shuffled",
              "rows": [], "sweeps": []}

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def bench_graph(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3

    def fmt(us, nbytes):
        if us is None:
            return f"{'n/a':>9} {'':>6}"
        return f"{us:9.1f} {nbytes / (us * 1e-6) / 1e9:6.0f}"

    if args.per_head_budget:
        result["per_head"] = per_head(pd, bench_graph, args, props.multi_processor_count, dtype)
        save(args, result)
        return
    for B in args.batches:
        for T in args.contexts:
            if T % S:
                raise SystemExit(f"context {T} must be a multiple of the page size {S}")
            P = T // S
            k_dense = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
            v_dense = torch.randn(B, Hkv, T, D, device=dev, dtype=dtype)
            q = torch.randn(B, H, D, device=dev, dtype=dtype)
            k_pages = k_dense.view(B * Hkv * P, S, D)
            v_pages = v_dense.view(B * Hkv * P, S, D)
            # Shuffling within each (request, KV head) keeps its set of tokens, so the output
            # (order-free over keys) still equals SDPA over the dense cache.
            base = torch.arange(B * Hkv, device=dev, dtype=torch.int64).view(B, Hkv, 1) * P
            if args.contiguous_pages:
                within = torch.arange(P, device=dev).expand(B, Hkv, P)
            else:
                within = torch.argsort(torch.rand(B, Hkv, P, device=dev), dim=-1)
            block_tables = (base + within).to(torch.int32).contiguous()
            seq_lens = torch.full((B,), T, device=dev, dtype=torch.int32)
            nbytes = 2 * B * Hkv * T * D * k_dense.element_size()

            sms = props.multi_processor_count
            splits = args.num_splits or pd.choose_num_splits(B, Hkv, T, sms)
            out = torch.empty_like(q)

            def run_kernel():
                pd.paged_decode_attention(
                    q, k_pages, v_pages, block_tables, seq_lens, out=out, num_splits=splits
                )

            def run_ref():
                pd.paged_decode_attention_ref(q, k_pages, v_pages, block_tables, seq_lens)

            # Decode GQA: the G query heads of a KV head form a length-G, non-causal query.
            q_sdpa = q.view(B, Hkv, G, D)

            def run_sdpa():
                return F.scaled_dot_product_attention(q_sdpa, k_dense, v_dense)

            if args.sweep:
                result["sweeps"].append(sweep(
                    pd, bench_graph, nbytes, B, T, splits,
                    q, k_pages, v_pages, block_tables, seq_lens, out,
                ))
                del k_dense, v_dense, k_pages, v_pages, block_tables, out
                torch.cuda.empty_cache()
                continue

            t_kernel = bench(run_kernel)
            t_graph = bench_graph(run_kernel)
            t_ref = None if args.no_ref else bench(run_ref)
            try:
                t_sdpa = bench(run_sdpa)
                sdpa_out = run_sdpa().reshape(B, H, D)
            except RuntimeError as e:  # e.g. no backend for this shape
                print(f"  sdpa failed: {e}")
                t_sdpa, sdpa_out = None, None

            run_kernel()
            if args.no_ref:
                err_ref = float("nan")
            else:
                ref = pd.paged_decode_attention_ref(q, k_pages, v_pages, block_tables, seq_lens)
                err_ref = (out.float() - ref.float()).abs().max().item()
            err_sdpa = float("nan")
            if sdpa_out is not None:
                err_sdpa = (out.float() - sdpa_out.float()).abs().max().item()
            print(
                f"{B:>3} {T:>7} {splits:>6} | {fmt(t_kernel, nbytes)} | "
                f"{t_graph:10.1f} {nbytes / (t_graph * 1e-6) / 1e9:6.0f} | "
                f"{fmt(t_ref, nbytes)} | {fmt(t_sdpa, nbytes)} | "
                f"{err_ref:10.2e} {err_sdpa:11.2e}",
                flush=True,
            )
            result["rows"].append({
                "batch": B, "context": T, "num_splits": splits, "kv_bytes": nbytes, "kernel_us": t_kernel,
                "graph_us": t_graph, "ref_us": t_ref, "sdpa_us": t_sdpa,
                "max_err_ref": None if math.isnan(err_ref) else err_ref,
                "max_err_sdpa": None if math.isnan(err_sdpa) else err_sdpa,
            })
            del k_dense, v_dense, k_pages, v_pages, block_tables, out
            torch.cuda.empty_cache()
    save(args, result)


def per_head(pd, bench, args, sms: int, dtype) -> list[dict]:
    """``--per-head-budget``: every layer's per-head lengths, proportional against balanced
    splits; one row per (B, context)."""
    import torch

    from spin_cluster.hplb.budget import synthetic_maxmin_budgets

    H, Hkv, D, S = args.heads, args.kv_heads, args.head_dim, args.page_size
    budgets = torch.tensor(synthetic_maxmin_budgets(args.layers, Hkv, args.per_head_budget, S))  # [L, Hkv]
    rows = []
    print(f"per-head lengths: S-HPLB budgets of {args.per_head_budget} tokens a head on average + 80, "
          f"{args.layers} layers (widest {int(budgets.max())})")
    for B in args.batches:
        for T in args.contexts:
            lens_all = (budgets + 80).clamp(max=T).to(torch.int32)  # [L, Hkv]
            W = int(lens_all.max())
            P = -(-W // S)
            dev = torch.device("cuda")
            pool = B * Hkv * P
            k_pages = torch.randn(pool, S, D, device=dev, dtype=dtype)
            v_pages = torch.randn_like(k_pages)
            tables = torch.randperm(pool, device=dev).view(B, Hkv, P).to(torch.int32)
            q = torch.randn(B, H, D, device=dev, dtype=dtype)
            out = torch.empty_like(q)
            t_prop = t_bal = 0.0
            nbytes = 0
            for layer in range(args.layers):
                lens = lens_all[layer].to(dev)[None].expand(B, Hkv).contiguous()
                width = int(lens_all[layer].max())
                nbytes += 2 * int(lens.sum()) * D * k_pages.element_size()
                splits = pd.choose_num_splits(B, Hkv, width, sms)
                tokens = pd.balanced_split_tokens(B, Hkv, float(lens_all[layer].float().mean()), width, sms)
                t_prop += bench(lambda: pd.paged_decode_attention(q, k_pages, v_pages, tables, lens, out=out,
                                                                  num_splits=splits, max_seq_len=width))
                t_bal += bench(lambda: pd.paged_decode_attention(q, k_pages, v_pages, tables, lens, out=out,
                                                                 split_tokens=tokens, max_seq_len=width))
                want = pd.paged_decode_attention_ref(q, k_pages, v_pages, tables, lens)
                err = (out.float() - want.float()).abs().max().item()
                if err > 0.05:
                    raise SystemExit(f"layer {layer}: balanced splits differ from the reference by {err}")
            gbs = [nbytes / (t * 1e-6) / 1e9 for t in (t_prop, t_bal)]
            print(f"B={B} ctx={T}: {args.layers} layers, proportional {t_prop:.1f} us ({gbs[0]:.0f} GB/s), "
                  f"balanced {t_bal:.1f} us ({gbs[1]:.0f} GB/s): {t_prop / t_bal:.2f}x", flush=True)
            rows.append({"batch": B, "context": T, "layers": args.layers, "kv_bytes": nbytes,
                         "proportional_us": t_prop, "balanced_us": t_bal})
            del k_pages, v_pages
            torch.cuda.empty_cache()
    return rows


def sweep(pd, bench, nbytes, B, T, splits, q, k_pages, v_pages, block_tables, seq_lens, out) -> dict:
    results = []
    split_opts = sorted({max(1, splits // 2), splits, splits * 2})
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (1, 2, 3, 4):
                for ns in split_opts:
                    kw = dict(
                        block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=ns
                    )
                    try:
                        us = bench(
                            lambda: pd.paged_decode_attention(
                                q, k_pages, v_pages, block_tables, seq_lens, out=out, **kw
                            )
                        )
                    except Exception as e:  # e.g. out of shared memory
                        print(f"  {kw}: failed ({type(e).__name__})")
                        continue
                    results.append((us, kw))
    results.sort(key=lambda r: r[0])
    default = bench(
        lambda: pd.paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, out=out)
    )
    print(f"B={B} ctx={T}: default {default:.1f} us ({nbytes / (default * 1e-6) / 1e9:.0f} GB/s)")
    for us, kw in results[:5]:
        print(f"    {us:9.1f} us {nbytes / (us * 1e-6) / 1e9:6.0f} GB/s  {kw}")
    print(f"    worst {results[-1][0]:.1f} us {results[-1][1]}", flush=True)
    return {"batch": B, "context": T, "default_us": default,
            "best": [{"us": us, **kw} for us, kw in results[:5]], "worst": {"us": results[-1][0], **results[-1][1]}}


if __name__ == "__main__":
    main()
