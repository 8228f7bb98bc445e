"""Benchmark the memory-hierarchy mechanisms on a GPU (not a test).

    python3 benchmarks/memory.py [--out memory.json] [--md memory.md]
                                 [--page-sizes 16 32 64] [--host-gib 2] [--slots 1048576]

1. Retrieve over scattered pages, head dim 128, bf16. A host pool of ``--host-gib`` GiB (K and
   V) in pinned memory; a random 25% of its pages is gathered into GPU slots, in random slot
   order. Reported in GB/s of K+V bytes moved:

   * ``retrieve``  -- ``retrieve_pages`` (one Triton launch, zero-copy reads of pinned memory)
   * ``memcpy``    -- one ``copy_(non_blocking=True)`` per page and tensor from a Python loop,
                      over a sample of ``--memcpy-pages`` pages (it is slow)
   * ``contig``    -- one pinned host->device copy of the same number of bytes
   * ``% contig``  -- retrieve / contig (goal >= 80%)

2. Eviction of 10% of ``--slots`` slots (ages uniform in ``[0, --max-age)``, 10% not
   evictable): bucketed LRU ``select_victims`` (Triton kernel, and the fixed-shape torch
   reference) against exact LRU by ``torch.sort`` and by ``torch.topk``, each as plain
   launches and replayed from a CUDA graph; speed-up = exact / bucketed Triton (goal >= 5x),
   and the share of the bucketed victims that exact LRU picks too.

Times are ``triton.testing.do_bench`` medians after warm-up (``do_bench_cudagraph`` for
graphs). Needs ``spin_cluster`` importable (PYTHONPATH, see ``gpu_setup.sh``), or runs from a
source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout without the package installed: last, after an installed one
    sys.path.append(_ROOT)
from spin_cluster.bench.args import add_out, save  # noqa: E402

HEAD_DIM = 128
GATHER_FRACTION = 0.25
EVICT_FRACTION = 0.10
PROTECTED_FRACTION = 0.10


def _import_modules():
    """``spin_cluster.kernels.retrieve`` and ``spin_cluster.profiling.lru``, also from a source
    checkout that is not pip-installed (there the top-level ``kernels/`` and ``profiling/``
    folders are the ``spin_cluster.kernels`` and ``spin_cluster.profiling`` packages)."""
    try:
        import spin_cluster.kernels.retrieve as retrieve
        import spin_cluster.profiling.lru as lru

        return retrieve, lru
    except ImportError:
        pass
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import spin_cluster

    for name in ("kernels", "profiling"):
        pkg_dir = os.path.join(_ROOT, name)
        spec = importlib.util.spec_from_file_location(
            f"spin_cluster.{name}",
            os.path.join(pkg_dir, "__init__.py"),
            submodule_search_locations=[pkg_dir],
        )
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[f"spin_cluster.{name}"] = pkg
        spec.loader.exec_module(pkg)
        setattr(spin_cluster, name, pkg)
    import spin_cluster.kernels.retrieve as retrieve
    import spin_cluster.profiling.lru as lru

    return retrieve, lru


def bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_graph_ms(fn):
    """Median replay time of ``fn`` captured in a CUDA graph, or None if it cannot be."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception as e:  # e.g. an op that syncs with the host during capture
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]})")
        return None


def gbps(nbytes, ms):
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------------------
# 1. Retrieve
# --------------------------------------------------------------------------------------


def host_pool_bytes(host_gib):
    """One pinned buffer, reused for every page size."""
    import torch

    nbytes = int(host_gib * (1 << 30))
    t0 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf.view(torch.int64).random_()  # any bit pattern: compared bitwise below
    print(f"pinned host pool: {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    return buf


def memcpy_per_page_ms(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, reps=3):
    """Wall time of one ``copy_`` per page and tensor, as a naive Retrieve would issue."""
    import torch

    pairs = list(zip(src_ids.tolist(), dst_ids.tolist()))
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s, d in pairs:
            dst_k[d].copy_(src_k[s], non_blocking=True)
            dst_v[d].copy_(src_v[s], non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_retrieved(src_k, dst_k, src_ids, dst_ids, sample=512):
    """Bitwise spot check of a sample of the gathered K pages."""
    import torch

    pick = torch.randperm(src_ids.shape[0])[:sample]
    s, d = src_ids.cpu()[pick], dst_ids.cpu()[pick]
    got = dst_k[d.cuda()].cpu().view(torch.int16)
    return bool(torch.equal(got, src_k[s].view(torch.int16)))


def bench_retrieve(retrieve, host_buf, S, args):
    import torch

    dtype = torch.bfloat16
    page_bytes = S * HEAD_DIM * 2  # one tensor (K or V)
    n_host = host_buf.numel() // (2 * page_bytes)
    n_gather = int(n_host * GATHER_FRACTION)
    host = host_buf[: 2 * n_host * page_bytes].view(dtype).view(2, n_host, S, HEAD_DIM)
    src_k, src_v = host[0], host[1]  # [N_host, S, D] each, pinned
    slots = torch.empty(2, n_gather, S, HEAD_DIM, dtype=dtype, device="cuda")
    dst_k, dst_v = slots[0], slots[1]  # [N_slots, S, D] each
    src_ids = torch.randperm(n_host, device="cuda")[:n_gather].to(torch.int32)
    dst_ids = torch.randperm(n_gather, device="cuda").to(torch.int32)
    count = torch.tensor([n_gather], dtype=torch.int32, device="cuda")
    nbytes = 2 * n_gather * page_bytes

    row = {"page_tokens": S, "page_kib": page_bytes / 1024, "host_pages": n_host,
           "gathered_pages": n_gather, "bytes": nbytes}
    for warps in args.retrieve_warps:
        def run():
            retrieve.retrieve_pages(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count,
                                    num_warps=warps)

        ms = bench_ms(run)
        row[f"retrieve_w{warps}_gbps"] = gbps(nbytes, ms)
    best = max(args.retrieve_warps, key=lambda w: row[f"retrieve_w{w}_gbps"])
    row["retrieve_warps"] = best
    row["retrieve_gbps"] = row[f"retrieve_w{best}_gbps"]
    slots.zero_()
    retrieve.retrieve_pages(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, count,
                            num_warps=best)
    torch.cuda.synchronize()
    row["retrieve_correct"] = check_retrieved(src_k, dst_k, src_ids, dst_ids)

    n_sample = min(args.memcpy_pages, n_gather)
    ms = memcpy_per_page_ms(src_k, src_v, dst_k, dst_v, src_ids[:n_sample], dst_ids[:n_sample])
    row["memcpy_pages"] = n_sample
    row["memcpy_gbps"] = gbps(2 * n_sample * page_bytes, ms)

    flat_dst = slots.view(-1).view(torch.uint8)
    flat_src = host_buf[:nbytes]
    row["contig_gbps"] = gbps(nbytes, bench_ms(lambda: flat_dst.copy_(flat_src, non_blocking=True)))
    row["retrieve_pct_contig"] = 100.0 * row["retrieve_gbps"] / row["contig_gbps"]
    del slots
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------
# 2. Eviction
# --------------------------------------------------------------------------------------


def eviction_inputs(num_slots, max_age):
    import torch

    now = 1_000_000
    g = torch.Generator(device="cuda").manual_seed(0)
    ages = torch.randint(0, max_age, (num_slots,), device="cuda", generator=g)
    last_use = (now - ages).to(torch.int32)  # [N]
    evictable = torch.rand(num_slots, device="cuda", generator=g) >= PROTECTED_FRACTION
    now_t = torch.tensor(now, device="cuda")
    need = torch.tensor([int(num_slots * EVICT_FRACTION)], device="cuda")
    return last_use, evictable, now_t, need


def bench_eviction(lru, args):
    import torch

    last_use, evictable, now, need = eviction_inputs(args.slots, args.max_age)
    need_int = int(need)
    nb, width = args.buckets, args.bucket_width
    runs = {
        "bucketed": lambda: lru.select_victims(
            last_use, evictable, now, need, nb, width, impl="triton"
        ),
        "bucketed_torch": lambda: lru.select_victims(
            last_use, evictable, now, need, nb, width, impl="torch"
        ),
        "exact_sort": lambda: lru.select_victims_exact(last_use, evictable, now, need, "sort"),
        "exact_topk": lambda: lru.select_victims_exact(
            last_use, evictable, now, need_int, "topk"
        ),
    }
    row = {"slots": args.slots, "needed": need_int, "buckets": nb, "bucket_width": width,
           "max_age": args.max_age}
    for name, fn in runs.items():
        row[f"{name}_ms"] = bench_ms(fn)
        row[f"{name}_graph_ms"] = bench_graph_ms(fn)

    mask, n = runs["bucketed"]()
    mask_torch, _ = runs["bucketed_torch"]()
    exact, n_exact = runs["exact_sort"]()
    row["num_victims"] = int(n)
    row["triton_equals_torch"] = bool(torch.equal(mask, mask_torch))
    row["agree_with_exact"] = float((mask & exact).sum()) / max(1, int(n_exact))
    for ref in ("exact_sort", "exact_topk"):
        for mode in ("", "_graph"):
            a, b = row[f"{ref}{mode}_ms"], row[f"bucketed{mode}_ms"]
            row[f"speedup_vs_{ref.split('_')[1]}{mode}"] = None if a is None or b is None else a / b
    del mask, mask_torch, exact
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def retrieve_table(rows):
    head = ("| S | page KiB (K) | pages gathered | retrieve GB/s | warps | memcpy GB/s "
            "| contig GB/s | retrieve % contig | correct |")
    lines = [head, "|---" * 9 + "|"]
    for r in rows:
        lines.append(
            f"| {r['page_tokens']} | {r['page_kib']:.0f} | {r['gathered_pages']} "
            f"| {fmt(r['retrieve_gbps'], '.1f')} | {r['retrieve_warps']} "
            f"| {fmt(r['memcpy_gbps'], '.2f')} | {fmt(r['contig_gbps'], '.1f')} "
            f"| {fmt(r['retrieve_pct_contig'], '.0f')}% | {r['retrieve_correct']} |"
        )
    return lines


def eviction_table(r):
    head = "| method | plain ms | graph ms | bucketed speed-up (plain / graph) |"
    lines = [head, "|---" * 4 + "|"]
    lines.append(f"| bucketed LRU, Triton | {fmt(r['bucketed_ms'], '.3f')} "
                 f"| {fmt(r['bucketed_graph_ms'], '.3f')} | 1 / 1 |")
    lines.append(f"| bucketed LRU, torch ops | {fmt(r['bucketed_torch_ms'], '.3f')} "
                 f"| {fmt(r['bucketed_torch_graph_ms'], '.3f')} | |")
    for ref in ("sort", "topk"):
        lines.append(
            f"| exact LRU, torch.{ref} | {fmt(r[f'exact_{ref}_ms'], '.3f')} "
            f"| {fmt(r[f'exact_{ref}_graph_ms'], '.3f')} "
            f"| {fmt(r[f'speedup_vs_{ref}'], '.1f')}x / {fmt(r[f'speedup_vs_{ref}_graph'], '.1f')}x |"
        )
    lines.append("")
    lines.append(
        f"{r['slots']} slots, {r['needed']} needed, ages uniform in [0, {r['max_age']}), "
        f"{PROTECTED_FRACTION:.0%} not evictable; {r['buckets']} buckets of "
        f"{r['bucket_width']} steps; {r['num_victims']} victims, {r['agree_with_exact']:.1%} "
        f"of them also exact-LRU victims; Triton == torch reference: {r['triton_equals_torch']}."
    )
    return lines


def metadata_rows(page_size=16, segment_pages=64, requests=64, layers=32, kv_heads=8,
                  contexts=(131072, 1048576), budget_tokens=2048):
    """GPU bytes of the page table: flat (one int32 per logical page) vs the two-level
    directory, for Llama-3.1-8B shapes. Arithmetic on the real classes (meta tensors)."""
    from spin_cluster.kvcache.directory import SegmentDirectory
    from spin_cluster.kvcache.host_tier import HostTier

    import torch

    host = HostTier(1, segment_pages, page_size, 1, torch.bfloat16, pin_memory=False)
    # The buffer's own per-column bookkeeping (slot, page, last use: 3 x int32), which a flat
    # design needs too, for a share of twice the pages a 2K-token budget selects.
    share = 2 * (budget_tokens // page_size + 1 + 4)
    buffer_bytes = requests * layers * kv_heads * share * 3 * 4
    rows = []
    for ctx in contexts:
        d = SegmentDirectory(host, layers, kv_heads, page_size, -(-ctx // page_size), requests, "meta")
        m = d.metadata_bytes()
        rows.append({"context": ctx, "flat_gpu_bytes": m["flat_gpu"], "directory_gpu_bytes": m["gpu"],
                     "ratio": m["flat_gpu"] / m["gpu"], "buffer_bookkeeping_gpu_bytes": buffer_bytes,
                     "page_size": page_size, "segment_pages": segment_pages, "requests": requests})
    return rows


def metadata_table(rows):
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    lines = ["| context | flat table (GPU) | two-level directory (GPU) | smaller by | buffer bookkeeping (both designs) |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context'] // 1024}K | {mib(r['flat_gpu_bytes'])} | {mib(r['directory_gpu_bytes'])} | "
                     f"{r['ratio']:.0f}x | {mib(r['buffer_bookkeeping_gpu_bytes'])} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(ap, md=True)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--host-gib", type=float, default=2.0, help="pinned host pool, K+V")
    ap.add_argument("--memcpy-pages", type=int, default=2000)
    ap.add_argument("--retrieve-warps", type=int, nargs="+", default=[4])
    ap.add_argument("--slots", type=int, default=1 << 20)
    ap.add_argument("--buckets", type=int, default=64)
    ap.add_argument("--bucket-width", type=int, default=2, help="steps per bucket")
    ap.add_argument("--max-age", type=int, default=128, help="ages drawn from [0, max_age)")
    ap.add_argument("--skip-retrieve", action="store_true")
    ap.add_argument("--skip-eviction", action="store_true")
    ap.add_argument("--metadata-only", action="store_true", help="page-table bytes only (no GPU needed)")
    args = ap.parse_args()
    meta = metadata_rows()
    meta_lines = ["## Page-table metadata on the GPU: Llama-3.1-8B shapes (32 layers, 8 KV heads), 64 requests,"
                  " page 16 tokens, segments of 64 pages", ""] + metadata_table(meta) + [""]
    if args.metadata_only:
        print("\n".join(meta_lines))
        return

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("benchmarks/memory.py needs a CUDA GPU")
    retrieve, lru = _import_modules()

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "head_dim": HEAD_DIM, "dtype": "bfloat16", "retrieve": [], "eviction": None}
    print(f"{props.name} | torch {torch.__version__} | triton {triton.__version__}", flush=True)

    if not args.skip_retrieve:
        host_buf = host_pool_bytes(args.host_gib)
        for S in args.page_sizes:
            row = bench_retrieve(retrieve, host_buf, S, args)
            result["retrieve"].append(row)
            print(json.dumps(row), flush=True)
        del host_buf
    if not args.skip_eviction:
        result["eviction"] = bench_eviction(lru, args)
        print(json.dumps(result["eviction"]), flush=True)

    result["metadata"] = meta
    lines = list(meta_lines)
    if result["retrieve"]:
        lines += ["## Retrieve: scattered pages, pinned host -> GPU (bf16, D=128, K+V)", ""]
        lines += retrieve_table(result["retrieve"]) + [""]
    if result["eviction"]:
        lines += ["## Eviction: 10% of the slots", ""] + eviction_table(result["eviction"])
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    save(args, result, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
