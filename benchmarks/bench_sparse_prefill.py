"""Block-sparse prefill on a GPU (not a test): kernel timings, head-parallel makespan, TTFT,
and the SmolLM2 accuracy of sparse prefill.

    python benchmarks/bench_sparse_prefill.py kernel   [--lengths 32768 65536 131072] [--budget 0.125]
    python benchmarks/bench_sparse_prefill.py ttft     [--lengths 32768 131072] [--budget 0.125]
    python benchmarks/bench_sparse_prefill.py accuracy [--lengths 4096 8192] [--budget 0.2]

kernel: Llama-3.1-8B attention shapes (H=32, Hkv=8, D=128, bf16), one whole prompt of T
tokens. Dense is torch SDPA (flash backend). Block-sparse runs the same data with uniform,
threshold and S-HPLB budgets at equal total block count: the threshold is bisected and the
S-HPLB per-head budgets are max-min shifted (``spin_cluster.hplb.budget``) from the heads'
needs measured on this data, both to compute as many blocks as uniform ``--budget``.
Times are medians of ``triton.testing.do_bench``: attention alone, and with selection
(estimate, budgets, select). Then, for 2/4/8 head-parallel ranks emulated on the one GPU
(each rank's KV heads timed alone), the makespan of greedy vs contiguous placement.
The synthetic q/k give heads different sparsity: keys carry a per-block bias along one
direction that queries share, of a per-head strength, so some heads concentrate their mass
on few blocks and others spread it.

ttft: time to first token of one prompt through the engine, random weights at
Llama-3.1-8B shapes, dense prefill vs block-sparse prefill with seeded heterogeneous
per-head budgets (mean ``--budget``; random weights have no profile).

accuracy: ``spin_cluster.profiling.evaluate`` on the default model (SmolLM2-135M-Instruct):
dense, and dense decode after sparse prefill with uniform, threshold and S-HPLB budgets at
the key blocks of uniform ``--budget``.

--out writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import random
import shutil
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, HKV, D = 32, 8, 128


def _import_package() -> None:
    """Use the installed package (pip, or /tmp/pkg on the GPU machine); from a bare source
    checkout, map the top-level ``kernels/`` and ``profiling/`` folders into it by path, as
    pyproject.toml does."""
    try:
        import spin_cluster.kernels  # noqa: F401
        import spin_cluster.profiling  # noqa: F401

        return
    except ImportError:
        pass
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import spin_cluster

    for name in ("kernels", "profiling"):
        pkg_dir = os.path.join(_ROOT, name)
        spec = importlib.util.spec_from_file_location(f"spin_cluster.{name}", os.path.join(pkg_dir, "__init__.py"),
                                                      submodule_search_locations=[pkg_dir])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[f"spin_cluster.{name}"] = pkg
        spec.loader.exec_module(pkg)
        setattr(spin_cluster, name, pkg)


# ---- kernel ------------------------------------------------------------------------------------


def _synthetic_qkv(T: int, device, seed: int = 0):
    """q [T, H, D], k, v [Hkv, T, D] bf16; KV head h's keys carry a block bias of strength
    0.5 * h along a direction the queries share (see the module docstring)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=g)
    k = torch.randn(HKV, T, D, device=device, generator=g)
    v = torch.randn(HKV, T, D, device=device, generator=g)
    e = torch.nn.functional.normalize(torch.randn(D, device=device, generator=g), dim=0)
    block_bias = torch.randn(-(-T // 128), device=device, generator=g).repeat_interleave(128)[:T]  # [T]
    strength = 0.5 * torch.arange(HKV, device=device, dtype=torch.float32)  # [Hkv]
    k += strength[:, None, None] * block_bias[None, :, None] * e * D**0.5 / 4
    q += e * 4.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _selectors(q, k, block_size, stride, budget, coverage):
    """name -> (select() -> (ids, counts)): the three budget modes at uniform's block count."""
    import torch

    from spin_cluster.sparse.prefill import (
        block_masses, budget_blocks, head_needs, middle_blocks, select_blocks, shifted_budgets, threshold_blocks,
    )

    T = q.shape[0]
    sink, local = 1, 1
    middle = middle_blocks(0, T, block_size, sink, local, q.device)
    J = middle.numel()
    masses = block_masses(q, k, 0, block_size, "antidiagonal", stride)
    uniform_b = budget_blocks(torch.full((HKV,), budget, device=q.device), middle)
    target = torch.minimum(uniform_b, middle).sum().item()
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        got = threshold_blocks(masses, 0, block_size, sink, local, mid).sum().item()
        lo, hi = (mid, hi) if got <= target else (lo, mid)
    tau = lo
    fractions = torch.tensor(shifted_budgets(head_needs([masses], 0, T, block_size, sink, local, coverage), budget)[0],
                             device=q.device)

    def uniform():
        m = block_masses(q, k, 0, block_size, "antidiagonal", stride)
        return select_blocks(m, budget_blocks(torch.full((HKV,), budget, device=q.device), middle), 0, block_size,
                             sink, local, math.ceil(budget * J))

    def threshold():
        m = block_masses(q, k, 0, block_size, "antidiagonal", stride)
        return select_blocks(m, threshold_blocks(m, 0, block_size, sink, local, tau), 0, block_size, sink, local, J)

    def hplb():
        m = block_masses(q, k, 0, block_size, "antidiagonal", stride)
        return select_blocks(m, budget_blocks(fractions, middle), 0, block_size, sink, local,
                             int(float(fractions.max()) * J) + 1)

    return {"uniform": uniform, "threshold": threshold, "s-hplb": hplb}, tau, fractions.tolist()


def _makespans(q, k, v, ids, counts, block_size, ranks_list, bench, attend):
    """{ranks: {placement: makespan ms}} with each rank's KV heads timed alone."""
    try:
        from spin_cluster.hplb.placement import contiguous_placement, greedy_placement
    except ImportError:
        print("spin_cluster.hplb.placement is not installed: makespan skipped")
        return {}
    G = H // HKV
    costs = [[float(c) for c in counts.sum(-1).tolist()]]  # [1][Hkv] blocks computed per KV head
    out = {}
    for R in ranks_list:
        row = {}
        for name, place in (("greedy", greedy_placement), ("contiguous", contiguous_placement)):
            owner = place(costs, R).kv_head_to_rank[0]
            times = []
            for r in range(R):
                kv = [h for h in range(HKV) if owner[h] == r]
                if not kv:
                    continue
                qh = [h * G + g for h in kv for g in range(G)]
                args = (q[:, qh].contiguous(), k[kv].contiguous(), v[kv].contiguous(),
                        ids[kv].contiguous(), counts[kv].contiguous(), 0, block_size)
                times.append(bench(lambda a=args: attend(*a)))
            row[name] = max(times)
        out[R] = row
    return out


def run_kernel(args) -> dict:
    import torch

    from spin_cluster.kernels.block_sparse_prefill import block_sparse_prefill, block_sparse_prefill_ref

    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        import triton.testing

        bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731  ms, median
        attend_fn, flash = block_sparse_prefill, [torch.nn.attention.SDPBackend.FLASH_ATTENTION]
    else:  # CPU smoke run at tiny sizes: the torch reference, 3 timed calls
        bench = _cpu_bench
        attend_fn, flash = block_sparse_prefill_ref, [torch.nn.attention.SDPBackend.MATH]
    results = {"lengths": {}, "budget": args.budget, "block_size": args.block_size, "stride": args.stride}
    for T in args.lengths:
        q, k, v = _synthetic_qkv(T, dev)
        qd, kd, vd = (q.transpose(0, 1)[None], k.repeat_interleave(H // HKV, 0)[None],
                      v.repeat_interleave(H // HKV, 0)[None])
        with torch.nn.attention.sdpa_kernel(flash):
            dense_ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
        selectors, tau, fractions = _selectors(q, k, args.block_size, args.stride, args.budget, args.coverage)
        row = {"dense_ms": dense_ms, "threshold": tau, "s_hplb_fractions": fractions, "modes": {}}
        causal = sum(range(1, -(-T // args.block_size) + 1)) * HKV
        for name, select in selectors.items():
            ids, counts = select()
            attn_ms = bench(lambda: attend_fn(q, k, v, ids, counts, 0, args.block_size))
            total_ms = bench(lambda: attend_fn(q, k, v, *select(), 0, args.block_size))
            density = counts.sum().item() / causal
            row["modes"][name] = {"density": density, "attention_ms": attn_ms, "with_selection_ms": total_ms,
                                  "speedup": dense_ms / attn_ms, "speedup_with_selection": dense_ms / total_ms,
                                  "bound": 1 / density}
            if name == "s-hplb":
                if T == args.lengths[0] and on_gpu:  # spot check against the reference: last 512 rows
                    cs = T - 512
                    m = -(-T // args.block_size) - cs // args.block_size
                    sub = (ids[:, -m:].contiguous(), counts[:, -m:].contiguous(), cs, args.block_size)
                    got, ref = block_sparse_prefill(q[cs:], k, v, *sub), block_sparse_prefill_ref(q[cs:], k, v, *sub)
                    row["max_abs_err_vs_ref"] = (got.float() - ref.float()).abs().max().item()
                if T == max(args.lengths):
                    results["makespan_ms"] = _makespans(q, k, v, ids, counts, args.block_size, args.ranks, bench,
                                                        attend_fn)
            print(f"T={T:>6} {name:>9}: density {density:.3f} attention {attn_ms:8.2f} ms "
                  f"(+selection {total_ms:8.2f} ms)  dense {dense_ms:8.2f} ms  "
                  f"speed-up {dense_ms / attn_ms:5.2f}x / {dense_ms / total_ms:5.2f}x (bound {1 / density:5.2f}x)",
                  flush=True)
        results["lengths"][str(T)] = row
    _print_kernel_table(results)
    return results


def _cpu_bench(fn) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _print_kernel_table(results: dict) -> None:
    print("\n| tokens | dense SDPA ms | method | blocks computed | attention ms (x dense) | with selection ms (x dense) | bound |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for T, row in results["lengths"].items():
        for name, m in row["modes"].items():
            print(f"| {int(T) // 1024}K | {row['dense_ms']:.1f} | {name} | {100 * m['density']:.1f}% | "
                  f"{m['attention_ms']:.1f} ({m['speedup']:.2f}x) | {m['with_selection_ms']:.1f} "
                  f"({m['speedup_with_selection']:.2f}x) | {m['bound']:.1f}x |")
    if results.get("makespan_ms"):
        print("\n| ranks | greedy makespan ms | contiguous makespan ms | contiguous / greedy |")
        print("|---:|---:|---:|---:|")
        for R, row in results["makespan_ms"].items():
            print(f"| {R} | {row['greedy']:.2f} | {row['contiguous']:.2f} | {row['contiguous'] / row['greedy']:.2f}x |")


# ---- ttft ------------------------------------------------------------------------------------------


def run_ttft(args) -> dict:
    import torch

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import SamplingParams
    from spin_cluster.engine import Engine
    from spin_cluster.models.shapes import LLAMA_31_8B, shape_folder

    longest = max(args.lengths)
    # Room for a prompt of `longest` plus its token; random weights (model.load_format: dummy).
    folder = shape_folder({**LLAMA_31_8B, "num_hidden_layers": args.layers}, longest + 256,
                          prefix="llama31-8b-shapes-")
    rng = random.Random(0)
    per_head = [[round(min(0.99, max(0.01, rng.lognormvariate(0, 0.6) * args.budget)), 3) for _ in range(HKV)]
                for _ in range(args.layers)]
    mean = sum(map(sum, per_head)) / (args.layers * HKV)
    per_head = [[round(min(0.99, b * args.budget / mean), 3) for b in row] for row in per_head]
    results = {"budget": args.budget, "per_head_budgets": per_head, "ttft_s": {}}
    for label, prefill in (("dense", {}), ("block-sparse", {"algorithm": "block", "block_size": 128, "stride": 16,
                                                            "budgets": "per_head", "per_head_budgets": per_head})):
        cfg = SpinConfig.from_dict({
            "model": {"path": folder, "load_format": "dummy", "dtype": "bfloat16", "max_model_len": longest + 16},
            "cache": {"kv_cache_gib": 2 * args.layers * HKV * D * 2 * (longest + 256) / 2**30 + 1},
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": longest + 16},
            "sparse": {"prefill": prefill},
        })
        engine = Engine(cfg, progress=False)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        warm = min(2048, min(args.lengths))
        engine.generate([[rng.randrange(1000, 40000) for _ in range(warm)]], params)  # warm-up (Triton compile)
        for T in args.lengths:
            prompt = [rng.randrange(1000, 40000) for _ in range(T)]
            _sync()
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            _sync()
            results["ttft_s"].setdefault(str(T), {})[label] = time.perf_counter() - t0
            print(f"TTFT {label:>12} T={T:>6}: {results['ttft_s'][str(T)][label]:.3f} s", flush=True)
        if prefill:
            results["density"] = engine.runner.attention.sparse_prefill.density()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    shutil.rmtree(folder, ignore_errors=True)
    print("\n| prompt tokens | dense TTFT s | block-sparse TTFT s | speed-up |\n|---:|---:|---:|---:|")
    for T, row in results["ttft_s"].items():
        print(f"| {int(T) // 1024}K | {row['dense']:.2f} | {row['block-sparse']:.2f} | {row['dense'] / row['block-sparse']:.2f}x |")
    print(f"blocks computed by sparse prefill: {100 * results['density']:.1f}% of causal")
    return results


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- accuracy --------------------------------------------------------------------------------


def run_accuracy(args) -> dict:
    from spin_cluster.profiling import report
    from spin_cluster.profiling.evaluate import EvalConfig, evaluate

    tasks = {"tasks": tuple(args.tasks)} if args.tasks else {}
    cfg = EvalConfig(**tasks, lengths=tuple(args.lengths), samples_per_task=args.samples, algorithms=("dense",), budgets=(),
                     prefill_modes=("uniform", "threshold", "hplb"), prefill_budget=args.budget,
                     prefill_block_size=args.block_size, max_batch=args.max_batch, device=args.device,
                     dtype=args.dtype)
    results = evaluate(cfg, progress=False)
    print(report.markdown(results), end="")
    print("\nblocks computed (share of causal):")
    for key, value in results.prefill_density.items():
        print(f"  {key}: {100 * value:.1f}%")
    print(f"{len(results.samples)} generations in {results.elapsed_s:.0f} s")
    return results.to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["kernel", "ttft", "accuracy"])
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=float, default=None,
                    help="uniform middle-block fraction (kernel, ttft: 0.125; accuracy: 0.2, about a quarter of all causal blocks at 4K-8K)")
    ap.add_argument("--block-size", type=int, default=None, help="kernel: 128; accuracy: 64")
    ap.add_argument("--stride", type=int, default=16, help="antidiagonal stride (kernel)")
    ap.add_argument("--coverage", type=float, default=0.9, help="mass the S-HPLB needs are measured at (kernel)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=32, help="ttft: decoder layers (fewer for a smoke run)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--tasks", nargs="+", default=None, help="accuracy: RULER-style tasks (default: all)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, metavar="JSON")
    args = ap.parse_args()
    defaults = {"kernel": ([32768, 65536, 131072], 0.125, 128), "ttft": ([32768, 131072], 0.125, 128),
                "accuracy": ([4096, 8192], 0.2, 64)}[args.what]
    args.lengths = args.lengths or defaults[0]
    args.budget = args.budget or defaults[1]
    args.block_size = args.block_size or defaults[2]
    _import_package()
    result = {"kernel": run_kernel, "ttft": run_ttft, "accuracy": run_accuracy}[args.what](args)
    if args.out:
        from spin_cluster.provenance import write_json

        write_json(args.out, result)


if __name__ == "__main__":
    main()
