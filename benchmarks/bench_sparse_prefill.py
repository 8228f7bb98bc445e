"""Block-sparse prefill on a GPU (not a test): kernel timings, head-parallel makespan, TTFT,
and the SmolLM2 accuracy of sparse prefill.

    python benchmarks/bench_sparse_prefill.py dense    [--lengths 32768 131072] [--chunk 2048]
    python benchmarks/bench_sparse_prefill.py kernel   [--lengths 32768 65536 131072] [--budget 0.125]
    python benchmarks/bench_sparse_prefill.py accuracy [--lengths 4096 8192] [--budget 0.2]

dense: the engine's dense prefill attention on each SDPA backend, a whole prompt and the same
prompt in scheduler-sized chunks (lower-right causal), with TFLOP/s.

kernel: Llama-3.1-8B attention shapes (H=32, Hkv=8, D=128, bf16), one whole prompt of T
tokens. Dense is the engine's dense prefill (``dense_attention``) on each SDPA backend
the GPU runs (flash, and cuDNN where the engine chooses it), reported apart; every speed-up is
against the fastest of them (the "baseline" column). Block-sparse runs the same data with uniform,
threshold and S-HPLB budgets at equal total block count: the threshold is bisected and the
S-HPLB per-head budgets are max-min shifted (``spin_cluster.hplb.budget``) from the heads'
needs measured on this data, both to compute as many blocks as uniform ``--budget``.
Times are medians of ``triton.testing.do_bench``: selection alone (estimate, budgets,
select; ``--estimator``, default strided), attention alone, and both; the kernel's TFLOP/s on
the blocks it visits; each mode's output error against dense. Then the threshold method at
S-HPLB's accuracy: its mass bisected until its output is as close to dense as S-HPLB's, its
blocks and time against S-HPLB's. Then, for 2/4/8 head-parallel ranks emulated on the one GPU
(each rank's KV heads timed alone), the makespan of greedy vs contiguous placement.
The synthetic q/k give heads different sparsity: keys carry a per-block bias along one
direction that queries share, of a per-head strength, so some heads concentrate their mass
on few blocks and others spread it.

TTFT through the engine is ``benchmarks/prefill_ttft.py``.

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
import sys
import time

from tqdm.auto import tqdm

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout without the package installed: last, after an installed one
    sys.path.append(_ROOT)
from spin_cluster.bench.args import add_device, add_out, save  # noqa: E402
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


def _selectors(q, k, block_size, estimator, stride, budget, coverage):
    """name -> (select() -> (ids, counts)): the three budget modes at uniform's block count,
    and threshold_at(tau) -> select() for any other mass."""
    import torch

    from spin_cluster.sparse.prefill import (
        block_masses, budget_blocks, head_needs, middle_blocks, select_blocks, shifted_budgets, threshold_blocks,
    )

    T = q.shape[0]
    sink, local = 1, 1
    middle = middle_blocks(0, T, block_size, sink, local, q.device)
    J = middle.numel()
    masses = block_masses(q, k, 0, block_size, estimator, stride)
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

    def estimate():
        return block_masses(q, k, 0, block_size, estimator, stride)

    def uniform():
        return select_blocks(estimate(), budget_blocks(torch.full((HKV,), budget, device=q.device), middle), 0,
                             block_size, sink, local, math.ceil(budget * J))

    def threshold_at(t):
        def threshold():
            m = estimate()
            return select_blocks(m, threshold_blocks(m, 0, block_size, sink, local, t), 0, block_size, sink, local, J)
        return threshold

    def hplb():
        return select_blocks(estimate(), budget_blocks(fractions, middle), 0, block_size, sink, local,
                             int(float(fractions.max()) * J) + 1)

    modes = {"uniform": uniform, "threshold": threshold_at(tau), "s-hplb": hplb}
    return modes, threshold_at, tau, fractions.tolist()


def _dense_baselines(q, k, v, bench):
    """({backend: ms}, fastest backend, its Kernel): the engine's dense prefill (``dense_prefill.run_kernel``, the
    layout and kernels of ``prefill_attention``) on flash and, where the device runs it, cuDNN;
    on the CPU the default (math) path."""
    from spin_cluster.dense_attention import Kernel, device_backend, run_kernel

    if q.device.type != "cuda":
        kernels = {"default": Kernel("default")}
    else:
        chosen = device_backend(q.device, q.dtype, H, HKV, D)
        kernels = {"flash": Kernel("flash")}
        if chosen.whole.name == "cudnn":
            kernels["cudnn"] = chosen.whole
    times = {}
    for name, kernel in kernels.items():
        try:
            times[name] = bench(lambda kernel=kernel: run_kernel(kernel, q, k, v, 0))
        except RuntimeError as e:
            print(f"dense {name}: {type(e).__name__}: {e}", flush=True)
    fastest = min(times, key=times.get)
    return times, fastest, kernels[fastest]


def _causal_tflop(T: int) -> float:
    """TFLOP of dense causal attention at T tokens (QK^T and PV over the causal half)."""
    return 2 * H * D * T * (T + 1) / 1e12


def _visited_tflop(counts, block_size: int) -> float:
    """TFLOP of the listed blocks (each query head of a KV head; diagonal blocks count half)."""
    full = counts.sum().item() - 0.5 * counts.numel()
    return 4 * block_size * block_size * D * (H // HKV) * full / 1e12


def _tokens(T) -> str:
    T = int(T)
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def _relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


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

    from spin_cluster.dense_attention import run_kernel as dense_kernel
    from spin_cluster.kernels.block_sparse_prefill import block_sparse_prefill, block_sparse_prefill_ref, tuned_config
    from spin_cluster.sparse.prefill import block_masses

    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        import triton.testing

        bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)  # noqa: E731  ms, median
        attend_fn = block_sparse_prefill
    else:  # CPU smoke run at tiny sizes: the torch reference, 3 timed calls
        bench = _cpu_bench
        attend_fn = block_sparse_prefill_ref
    results = {"lengths": {}, "budget": args.budget, "block_size": args.block_size, "stride": args.stride,
               "estimator": args.estimator}
    for T in tqdm(args.lengths, desc="prefill kernels", disable=not sys.stderr.isatty()):
        q, k, v = _synthetic_qkv(T, dev)
        dense_ms, fastest, fastest_kernel = _dense_baselines(q, k, v, bench)
        base_ms = dense_ms[fastest]
        dense_out = dense_kernel(fastest_kernel, q, k, v, 0)
        selectors, threshold_at, tau, fractions = _selectors(q, k, args.block_size, args.estimator, args.stride,
                                                             args.budget, args.coverage)
        row = {"dense_ms": dense_ms, "dense_backend": fastest,
               "dense_tflops": {b: _causal_tflop(T) / (ms / 1e3) for b, ms in dense_ms.items()},
               "threshold": tau, "s_hplb_fractions": fractions, "modes": {},
               "antidiagonal_estimate_ms": bench(lambda: block_masses(q, k, 0, args.block_size, "antidiagonal", 16)),
               "estimate_ms": bench(lambda: block_masses(q, k, 0, args.block_size, args.estimator, args.stride))}
        causal = sum(range(1, -(-T // args.block_size) + 1)) * HKV
        for name, select in selectors.items():
            ids, counts = select()
            select_ms = bench(select)
            attn_ms = bench(lambda: attend_fn(q, k, v, ids, counts, 0, args.block_size))
            total_ms = bench(lambda: attend_fn(q, k, v, *select(), 0, args.block_size))
            density = counts.sum().item() / causal
            error = _relative_error(attend_fn(q, k, v, ids, counts, 0, args.block_size), dense_out)
            row["modes"][name] = {
                "density": density, "selection_ms": select_ms, "attention_ms": attn_ms, "with_selection_ms": total_ms,
                "selection_share": select_ms / total_ms, "relative_error": error,
                "visited_tflops": _visited_tflop(counts, args.block_size) / (attn_ms / 1e3),
                "speedup": base_ms / attn_ms, "speedup_with_selection": base_ms / total_ms,
                "speedup_with_selection_by_backend": {b: ms / total_ms for b, ms in dense_ms.items()},
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
            m = row["modes"][name]
            print(f"T={T:>6} {name:>9}: density {density:.3f} selection {select_ms:7.2f} ms attention {attn_ms:8.2f} ms "
                  f"(+selection {total_ms:8.2f} ms, {100 * m['selection_share']:.0f}% selection)  dense "
                  f"{fastest} {base_ms:8.2f} ms  speed-up {base_ms / attn_ms:5.2f}x / {base_ms / total_ms:5.2f}x "
                  f"(bound {1 / density:5.2f}x)  {m['visited_tflops']:.0f} TFLOP/s on visited blocks, "
                  f"error {error:.4f}", flush=True)
        row["equal_accuracy"] = _threshold_at_hplb_accuracy(q, k, v, dense_out, threshold_at, row["modes"]["s-hplb"],
                                                            causal, attend_fn, bench, args.block_size)
        results["lengths"][str(T)] = row
        del q, k, v, dense_out
    if on_gpu:
        results["kernel_tile"] = tuned_config(args.block_size, D, H // HKV)
    _print_kernel_table(results)
    return results


def _threshold_at_hplb_accuracy(q, k, v, dense_out, threshold_at, hplb, causal, attend_fn, bench, block_size,
                                steps: int = 8) -> dict:
    """The threshold method at S-HPLB's accuracy: the smallest mass tau (bisected) whose output
    is as close to dense as S-HPLB's (relative error), its blocks and time against S-HPLB's."""
    target = hplb["relative_error"]
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        ids, counts = threshold_at(mid)()
        ok = _relative_error(attend_fn(q, k, v, ids, counts, 0, block_size), dense_out) <= target
        lo, hi = (lo, mid) if ok else (mid, hi)
    select = threshold_at(hi)
    ids, counts = select()
    total_ms = bench(lambda: attend_fn(q, k, v, *select(), 0, block_size))
    out = {"threshold": hi, "density": counts.sum().item() / causal,
           "relative_error": _relative_error(attend_fn(q, k, v, ids, counts, 0, block_size), dense_out),
           "with_selection_ms": total_ms, "s_hplb_with_selection_ms": hplb["with_selection_ms"],
           "s_hplb_density": hplb["density"], "s_hplb_speedup": total_ms / hplb["with_selection_ms"]}
    print(f"  equal accuracy (error <= {target:.4f}): threshold tau {hi:.3f} computes {100 * out['density']:.1f}% "
          f"of causal blocks in {total_ms:.2f} ms; S-HPLB {100 * hplb['density']:.1f}% in "
          f"{hplb['with_selection_ms']:.2f} ms: S-HPLB {out['s_hplb_speedup']:.2f}x", flush=True)
    return out


def _cpu_bench(fn) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _print_kernel_table(results: dict) -> None:
    print(f"\nestimator: {results['estimator']} (stride {results['stride']}); block {results['block_size']}; "
          f"kernel tile: {results.get('kernel_tile')}")
    print("\n| tokens | dense flash ms (TFLOP/s) | dense cuDNN ms (TFLOP/s) | baseline | method | blocks computed | "
          "selection ms | attention ms (TFLOP/s visited) | with selection ms | selection share | x baseline | "
          "x baseline with selection | bound | rel. error |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, row in results["lengths"].items():
        dense = {b: f"{row['dense_ms'][b]:.1f} ({row['dense_tflops'][b]:.0f})" if b in row["dense_ms"] else "-"
                 for b in ("flash", "cudnn")}
        for name, m in row["modes"].items():
            print(f"| {_tokens(T)} | {dense['flash']} | {dense['cudnn']} | {row['dense_backend']} | {name} | "
                  f"{100 * m['density']:.1f}% | {m['selection_ms']:.1f} | {m['attention_ms']:.1f} "
                  f"({m['visited_tflops']:.0f}) | {m['with_selection_ms']:.1f} | {100 * m['selection_share']:.0f}% | "
                  f"{m['speedup']:.2f}x | {m['speedup_with_selection']:.2f}x | {m['bound']:.1f}x | "
                  f"{m['relative_error']:.4f} |")
    print("\n| tokens | estimate ms | antidiagonal (stride 16) estimate ms | S-HPLB error | threshold tau at that error | "
          "threshold blocks | S-HPLB blocks | threshold ms | S-HPLB ms | S-HPLB / threshold speed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, row in results["lengths"].items():
        e = row["equal_accuracy"]
        print(f"| {_tokens(T)} | {row['estimate_ms']:.2f} | {row['antidiagonal_estimate_ms']:.2f} | "
              f"{row['modes']['s-hplb']['relative_error']:.4f} | {e['threshold']:.3f} | {100 * e['density']:.1f}% | "
              f"{100 * e['s_hplb_density']:.1f}% | {e['with_selection_ms']:.1f} | {e['s_hplb_with_selection_ms']:.1f} | "
              f"{e['s_hplb_speedup']:.2f}x |")
    if results.get("makespan_ms"):
        print("\n| ranks | greedy makespan ms | contiguous makespan ms | contiguous / greedy |")
        print("|---:|---:|---:|---:|")
        for R, row in results["makespan_ms"].items():
            print(f"| {R} | {row['greedy']:.2f} | {row['contiguous']:.2f} | {row['contiguous'] / row['greedy']:.2f}x |")


# ---- dense ------------------------------------------------------------------------------------


def run_dense(args) -> dict:
    """The engine's dense prefill attention (``dense_prefill.dense_causal_attention``, what
    ``prefill_attention`` runs) at Llama-3.1-8B attention shapes, one whole prompt and the
    same prompt in chunks of ``--chunk`` tokens (chunked prefill's lower-right mask), on flash
    and on the engine's choice: ms, TFLOP/s of the causal work, and the chunks' largest
    difference from the whole prompt's output."""
    import torch

    from spin_cluster.dense_attention import DenseBackend, dense_causal_attention, device_backend

    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    chosen = device_backend(dev, torch.bfloat16, H, HKV, D)
    backends = {"flash": DenseBackend.of("flash"), chosen.name: chosen} if on_gpu else {"default": chosen}
    results = {"engine_backend": chosen.name, "chunk": args.chunk, "lengths": {}}
    print(f"dense prefill backend of the engine: {chosen}", flush=True)
    for T in args.lengths:
        q, k, v = _synthetic_qkv(T, dev)
        row = {}
        for name, backend in backends.items():
            def whole(backend=backend):
                return dense_causal_attention(q, k, v, 0, backend)

            def chunked(backend=backend):
                return [dense_causal_attention(q[c:c + args.chunk], k[:, :c + args.chunk], v[:, :c + args.chunk], c,
                                               backend) for c in range(0, T, args.chunk)]

            # The first call of each shape includes kernel set-up (cuDNN builds a graph per shape).
            whole_first_ms, whole_ms = _timed_ms(whole, args.repeats)
            chunked_first_ms, chunked_ms = _timed_ms(chunked, args.repeats)
            diff = (torch.cat(chunked()).float() - whole().float()).abs().max().item()
            row[name] = {"whole_ms": whole_ms, "chunked_ms": chunked_ms, "whole_first_call_ms": whole_first_ms,
                         "chunked_first_call_ms": chunked_first_ms,
                         "whole_tflops": _causal_tflop(T) / (whole_ms / 1e3),
                         "chunked_tflops": _causal_tflop(T) / (chunked_ms / 1e3), "chunked_vs_whole_max_abs": diff}
            print(f"dense {name:>6} T={T:>6}: whole {whole_ms:8.2f} ms ({row[name]['whole_tflops']:.0f} TFLOP/s), "
                  f"{args.chunk}-token chunks {chunked_ms:8.2f} ms ({row[name]['chunked_tflops']:.0f} TFLOP/s), "
                  f"chunks vs whole max abs {diff:.2e}; first calls {whole_first_ms:.1f} / {chunked_first_ms:.1f} ms",
                  flush=True)
        results["lengths"][str(T)] = row
        del q, k, v
    print(f"\n| tokens | backend | whole prompt ms (TFLOP/s) | {args.chunk}-token chunks ms (TFLOP/s) |\n|---:|---|---:|---:|")
    for T, row in results["lengths"].items():
        for name, r in row.items():
            print(f"| {_tokens(T)} | {name} | {r['whole_ms']:.1f} ({r['whole_tflops']:.0f}) | "
                  f"{r['chunked_ms']:.1f} ({r['chunked_tflops']:.0f}) |")
    return results


def _timed_ms(fn, repeats: int) -> tuple[float, float]:
    """(first call, median of ``repeats`` later calls): wall times, synchronised (ms)."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    first = 1e3 * (time.perf_counter() - t0)
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return first, statistics.median(times)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- accuracy --------------------------------------------------------------------------------


def run_accuracy(args) -> dict:
    from spin_cluster.profiling import report
    from spin_cluster.profiling.evaluate import EvalConfig, evaluate

    tasks = {"tasks": tuple(args.tasks)} if args.tasks else {}
    base = {"model": {"device": args.device, "dtype": args.dtype}, "scheduler": {"max_num_seqs": args.max_batch}}
    cfg = EvalConfig(base=base, **tasks, lengths=tuple(args.lengths), samples_per_task=args.samples,
                     algorithms=("dense",), budgets=(), prefill_modes=("uniform", "threshold", "hplb"),
                     prefill_budget=args.budget, prefill_block_size=args.block_size, prefill_estimator=args.estimator,
                     prefill_stride=min(args.stride, args.block_size))
    results = evaluate(cfg, progress=False)
    print(report.markdown(results), end="")
    print("\nblocks computed (share of causal):")
    for key, value in results.prefill_density.items():
        print(f"  {key}: {100 * value:.1f}%")
    print(f"{len(results.samples)} generations in {results.elapsed_s:.0f} s")
    return results.to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["dense", "kernel", "accuracy"])
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=float, default=None,
                    help="uniform middle-block fraction (kernel: 0.125; accuracy: 0.2, about a quarter of all causal blocks at 4K-8K)")
    ap.add_argument("--block-size", type=int, default=None, help="kernel: 128; accuracy: 64")
    ap.add_argument("--stride", type=int, default=16, help="estimate stride: antidiagonal spacing or query group (kernel)")
    ap.add_argument("--estimator", default="strided", choices=["strided", "antidiagonal", "pooled"],
                    help="key-block estimate of sparse prefill (kernel)")
    ap.add_argument("--coverage", type=float, default=0.9, help="mass the S-HPLB needs are measured at (kernel)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--chunk", type=int, default=2048, help="dense: chunk tokens (the scheduler's default)")
    ap.add_argument("--repeats", type=int, default=3, help="dense: timed repeats (median)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--tasks", nargs="+", default=None, help="accuracy: RULER-style tasks (default: all)")
    add_device(ap, default="auto")
    ap.add_argument("--dtype", default="auto")
    add_out(ap)
    args = ap.parse_args()
    defaults = {"dense": ([32768, 131072], 0.125, 128), "kernel": ([32768, 65536, 131072], 0.125, 128),
                "accuracy": ([4096, 8192], 0.2, 64)}[args.what]
    args.lengths = args.lengths or defaults[0]
    args.budget = args.budget or defaults[1]
    args.block_size = args.block_size or defaults[2]
    _import_package()
    result = {"dense": run_dense, "kernel": run_kernel, "accuracy": run_accuracy}[args.what](args)
    save(args, result)


if __name__ == "__main__":
    main()
