"""Time to first token of one long prompt through the engine (not a test).

    python benchmarks/prefill_ttft.py [--lengths 32768 131072] [--budget 0.125] [--profile]

Random weights at Llama-3.1-8B shapes (``model.load_format: dummy``). Variants, each on a
fresh engine and fresh prompts:

* ``dense``: dense prefill on the engine's own backend (cuDNN on Hopper), the whole prompt
  in one step; ``--runs`` prompts per length.
* ``dense-chunked``: the same, in the scheduler's default 2K-token chunks (vLLM's chunked
  prefill); ``--ref-runs`` prompts, to show which dense schedule is the stronger baseline.
* ``dense-flash``: whole prompt, SDPA's flash kernel forced (``SPIN_DENSE_PREFILL=flash``),
  the backend dense used before; ``--ref-runs`` prompts.
* ``block-sparse``: sparse prefill (``sparse.prefill``), whole prompt, seeded heterogeneous
  per-head budgets of mean ``--budget`` (random weights have no profile to take them from).
* with ``--spin-chunk N``: ``dense-<N>`` (dense, N-token chunks) beside ``spin-<N>`` (Spin's
  cache: pages born on the GPU, a host tier behind them, Quest's index built as pages fill,
  per-head decode budgets; the dense prefill kernel), the same N-token chunks: what Spin's
  cache adds to a prefill, the e2e runs' 128K setting (two 64K chunks) when N is 65536; with
  ``--sparse-chunks`` also ``block-sparse-<N>`` beside ``spin-sparse-<N>``: both with sparse
  prefill, the serving runs' path (the stream's 32K chunks when N is 32768), where each chunk
  after the first reads its context from Spin's home pages.

Reported: median, min and max seconds per variant and length; the speed-up of block-sparse
against the fastest dense variant. ``--profile`` then runs one prompt of the longest length
per variant under ``torch.profiler`` and prints where its GPU time goes: attention, GEMMs,
the sparse selection, and the rest, with the top kernels.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time

from bench_sparse_prefill import D, H, HKV, _import_package, _sync, _tokens

from spin_cluster.bench.args import add_out, add_tokenizer, save


def _engine(folder: str, longest: int, layers: int, prefill: dict, chunk: int | None, on_gpu: bool,
            spin: bool = False):
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine
    from spin_cluster.hplb.budget import synthetic_maxmin_budgets

    scheduler = {"max_num_seqs": 1, "max_num_batched_tokens": longest + 16}
    if chunk:
        scheduler = {"max_num_seqs": 1, "max_num_batched_tokens": chunk, "enable_chunked_prefill": True}
    kv_gib = 2 * layers * HKV * D * 2 * (longest + 256) / 2**30 + 1
    cache, sparse = {"kv_cache_gib": kv_gib}, {"prefill": prefill}
    if spin:  # e2e.py's spin mode: home pages and the buffer in the same GPU bytes, a host tier
        page = 32
        cache = {"kv_cache_gib": kv_gib, "page_size": page, "kind": "offloaded", "host_kv_gib": kv_gib}
        sparse = {"algorithm": "quest", "budget": 2048, "local_tokens": 2 * page, "sink_tokens": page,
                  "options": {"index_dtype": "bfloat16",
                              "per_head_budgets": synthetic_maxmin_budgets(layers, HKV, 2048, page)},
                  "prefill": prefill}
    cfg = SpinConfig.from_dict({
        "model": {"path": folder, "load_format": "dummy", "dtype": "bfloat16" if on_gpu else "float32",
                  "max_model_len": longest + 16},
        "cache": cache,
        "scheduler": scheduler,
        "sparse": sparse,
    })
    return Engine(cfg, progress=False)


def _prompt(T: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(T)]


def _kernel_class(name: str) -> str:
    """``profile_tools.kernel_part``, with sparse and dense attention told apart."""
    from profile_tools import kernel_part

    part = kernel_part(name)
    if part == "attention":
        return "sparse attention" if "block_sparse_prefill" in name.lower() else "dense attention"
    return part


def _profile(engine, prompt: list[int], params) -> dict:
    """GPU time of one prompt by kernel class and the top kernels (ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], params)
        _sync()
    by_class: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        ms = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        if ms <= 0:
            continue
        kernels.append((ms, e.count, e.key))
        cls = _kernel_class(e.key)
        by_class[cls] = by_class.get(cls, 0.0) + ms
    kernels.sort(reverse=True)
    return {"by_class_ms": by_class, "total_ms": sum(by_class.values()),
            "top": [{"ms": ms, "calls": n, "kernel": k[:120]} for ms, n, k in kernels[:15]]}


def run(args) -> dict:
    import torch

    from spin_cluster.engine import SamplingParams
    from spin_cluster.dense_attention import device_backend
    from spin_cluster.hplb.budget import synthetic_prefill_config
    from spin_cluster.models.shapes import LLAMA_31_8B, shape_folder

    longest = max(args.lengths)
    folder = shape_folder({**LLAMA_31_8B, "num_hidden_layers": args.layers}, longest + 256, args.tokenizer,
                          prefix="llama31-8b-shapes-")
    sparse = synthetic_prefill_config(args.layers, HKV, args.budget, args.block_size, args.estimator, args.stride)
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    chosen = device_backend(dev, torch.bfloat16 if on_gpu else torch.float32, H, HKV, D).name
    # (label, sparse prefill config, forced dense kernel, chunk tokens, timed prompts, Spin's cache)
    variants = [("dense", {}, None, None, args.runs, False), ("block-sparse", sparse, None, None, args.runs, False)]
    if args.ref_runs:
        variants.insert(1, ("dense-chunked", {}, None, args.chunk, args.ref_runs, False))
        if chosen != "flash" and on_gpu:
            variants.insert(0, ("dense-flash", {}, "flash", None, args.ref_runs, False))
    if args.spin_chunk:
        n = args.spin_chunk
        variants = [(f"dense-{n}", {}, None, n, args.runs, False), (f"spin-{n}", {}, None, n, args.runs, True)]
        if args.sparse_chunks:
            variants += [(f"block-sparse-{n}", sparse, None, n, args.runs, False),
                         (f"spin-sparse-{n}", sparse, None, n, args.runs, True)]
    results = {"budget": args.budget, "per_head_budgets": sparse["options"]["per_head_budgets"],
               "dense_backend": chosen, "chunk": args.chunk, "spin_chunk": args.spin_chunk, "estimator": args.estimator, "stride": args.stride, "ttft_s": {}, "profile": {}}
    print(f"dense prefill backend of the engine: {chosen}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for label, prefill, force, chunk, runs, spin in variants:
        if force:
            os.environ["SPIN_DENSE_PREFILL"] = force
        engine = _engine(folder, longest, args.layers, prefill, chunk, on_gpu, spin)
        try:
            # Warm-up: compile, and tune the sparse kernel for every size class timed below.
            engine.generate([_prompt(min(2048, min(args.lengths)), 1)], params)
            if prefill and args.warm_lengths:
                for T in args.lengths:
                    engine.generate([_prompt(T, 2)], params)
            for T in args.lengths:
                times = []
                for run_i in range(runs):
                    prompt = _prompt(T, T * 100 + run_i)
                    _sync()
                    t0 = time.perf_counter()
                    engine.generate([prompt], params)
                    _sync()
                    times.append(time.perf_counter() - t0)
                stats = {"median": statistics.median(times), "min": min(times), "max": max(times), "runs": times}
                results["ttft_s"].setdefault(str(T), {})[label] = stats
                print(f"TTFT {label:>13} T={T:>6}: {stats['median']:.3f} s (min {stats['min']:.3f}, "
                      f"max {stats['max']:.3f}, {runs} runs)", flush=True)
            if args.profile and (label in ("dense", "block-sparse") or args.spin_chunk):
                prof = _profile(engine, _prompt(longest, 7), params)
                results["profile"][label] = prof
                _print_profile(label, longest, prof)
            if prefill:
                results["density"] = engine.runner.attention.sparse_prefill.density()
        finally:
            os.environ.pop("SPIN_DENSE_PREFILL", None)
            del engine
            if on_gpu:
                torch.cuda.empty_cache()
    shutil.rmtree(folder, ignore_errors=True)
    _print_table(results)
    return results


def _print_profile(label: str, T: int, prof: dict) -> None:
    print(f"\nGPU time of one {_tokens(T)} prompt, {label}: {prof['total_ms']:.0f} ms")
    for cls, ms in sorted(prof["by_class_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {cls:<36} {ms:9.1f} ms  {100 * ms / prof['total_ms']:5.1f}%")
    for k in prof["top"]:
        print(f"    {k['ms']:9.1f} ms {k['calls']:6d} calls  {k['kernel']}")


def _print_table(results: dict) -> None:
    chosen = results["dense_backend"]
    if results.get("spin_chunk"):
        n = results["spin_chunk"]
        print(f"\n| prompt tokens | prefill | {n}-token chunks, paged cache s (min-max) | Spin's cache, same chunks "
              f"s (min-max) | Spin / paged |\n|---|---|---:|---:|---:|")
        for T, row in results["ttft_s"].items():
            for kind, plain, spin in (("dense", f"dense-{n}", f"spin-{n}"),
                                      ("block-sparse", f"block-sparse-{n}", f"spin-sparse-{n}")):
                if plain in row and spin in row:
                    d, p = row[plain], row[spin]
                    print(f"| {_tokens(T)} | {kind} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | "
                          f"{p['median']:.2f} ({p['min']:.2f}-{p['max']:.2f}) | {p['median'] / d['median']:.3f}x |")
        return
    print(f"\n| prompt tokens | dense {chosen} whole TTFT s (min-max) | dense {chosen} {results['chunk']}-token chunks s "
          f"| dense flash s | block-sparse TTFT s (min-max) | sparse vs fastest dense |\n|---:|---:|---:|---:|---:|---:|")
    for T, row in results["ttft_s"].items():
        d, b = row["dense"], row["block-sparse"]
        fastest = min(r["median"] for name, r in row.items() if name != "block-sparse")
        cell = {name: f"{row[name]['median']:.2f}" if name in row else "-" for name in ("dense-chunked", "dense-flash")}
        print(f"| {_tokens(T)} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {cell['dense-chunked']} | "
              f"{cell['dense-flash']} | {b['median']:.2f} ({b['min']:.2f}-{b['max']:.2f}) | {fastest / b['median']:.2f}x |")
    if "density" in results:
        print(f"blocks computed by sparse prefill: {100 * results['density']:.1f}% of causal; estimator "
              f"{results['estimator']} (stride {results['stride']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--budget", type=float, default=0.125, help="mean middle-block fraction of sparse prefill")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--stride", type=int, default=16, help="estimate stride (query group of the strided estimate)")
    ap.add_argument("--estimator", default="strided", choices=["strided", "antidiagonal", "pooled"])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (fewer for a smoke run)")
    add_tokenizer(ap)
    ap.add_argument("--runs", type=int, default=3, help="timed prompts per length of dense and block-sparse (median)")
    ap.add_argument("--ref-runs", type=int, default=1,
                    help="timed prompts of the reference dense variants (chunked, flash); 0 leaves them out")
    ap.add_argument("--chunk", type=int, default=2048, help="chunk tokens of the dense-chunked variant")
    ap.add_argument("--warm-lengths", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed sparse prompt per length first (the kernel tunes once per size class)")
    ap.add_argument("--profile", action="store_true", help="kernel time of one longest prompt, dense and sparse")
    ap.add_argument("--spin-chunk", type=int, default=0, metavar="N",
                    help="instead of the variants above: dense beside Spin's cache, both in N-token chunks")
    ap.add_argument("--sparse-chunks", action="store_true",
                    help="with --spin-chunk: also block-sparse prefill beside Spin's cache with it, same chunks")
    add_out(ap)
    args = ap.parse_args()
    _import_package()
    save(args, run(args))


if __name__ == "__main__":
    main()
