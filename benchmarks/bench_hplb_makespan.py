"""Head-parallel attention makespan under contiguous vs greedy head placement (not a test).

    python benchmarks/bench_hplb_makespan.py [--context 131072] [--batch 32] [--ranks 2 4 8]
                                             [--budgets budgets.json] [--out r.json --md r.md]

Llama-3.1-8B attention shapes by default: L=32 layers, H=32 query heads, Hkv=8 KV heads,
D=128, bf16, B decode requests of ``--context`` tokens each. Every (layer, KV head) has its own
middle budget (S-HPLB); a decode step reads sink + budget + local tokens per KV head.

Budgets: ``--budgets`` is a JSON file holding [L'][Hkv'] token budgets (a list, or a mapping
with "budgets" or "per_head_budgets"), e.g. a profile measured on SmolLM2 (30 x 3): it is
stretched to L x Hkv by nearest index (layer l <- l * L' // L, head h <- h * Hkv' // Hkv) and
rescaled to a mean of ``--mean-budget``. Without it: a synthetic heterogeneous profile, budgets
drawn from a lognormal (``--sigma``, seeded ``--seed``) and scaled to the same mean. Budgets are
rounded to whole pages.

Head-parallel ranks meet at every layer's all-reduce, so a step's attention time is, over
layers, the sum of the slowest rank's time. One GPU stands in for the ranks: for every layer
and every rank, the rank's KV heads (with their query heads) are timed alone with the Triton
paged decode kernel (per-head lengths), and

    makespan = sum_l max_r time(layer l, heads of rank r)

for each rank count, under the contiguous split and under ``greedy_placement``, in the same run.
Dense is torch SDPA (flash) over the whole context, the same for every layer. Timings: CUDA
graphs of ``--reps`` calls, the median of ``--trials`` replays, cycling over ``--copies``
disjoint sets of pages so that repeated calls do not hit in L2. Select (scoring the pages)
is not timed: these are attention times only. ``--device cpu`` runs the same sequence with
the torch reference and wall-clock timing, for tiny smoke runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from spin_cluster.bench.args import add_device, add_out, add_shape, save
from spin_cluster.hplb.placement import HeadPlacement, contiguous_placement, greedy_placement, head_costs
from spin_cluster.kernels import paged_decode
from spin_cluster.parallel.timing import bubble_ratio


def synthetic_budgets(num_layers: int, num_kv_heads: int, sigma: float, seed: int) -> np.ndarray:
    """[L, Hkv] lognormal relative needs (mean 1 after ``scale_budgets``)."""
    return np.random.default_rng(seed).lognormal(0.0, sigma, (num_layers, num_kv_heads))


def stretch_budgets(budgets: np.ndarray, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """[L', Hkv'] -> [L, Hkv] by nearest index."""
    src_l, src_h = budgets.shape
    rows = np.arange(num_layers) * src_l // num_layers
    cols = np.arange(num_kv_heads) * src_h // num_kv_heads
    return budgets[np.ix_(rows, cols)]


def scale_budgets(needs: np.ndarray, mean_tokens: int, page_size: int, max_tokens: int) -> list[list[int]]:
    """Relative needs -> whole-page token budgets with the given mean, in [page_size, max_tokens]."""
    tokens = needs / needs.mean() * mean_tokens
    pages = np.clip(np.round(tokens / page_size), 1, max_tokens // page_size)
    return (pages * page_size).astype(int).tolist()


def load_budgets(path: str) -> np.ndarray:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("per_head_budgets", data.get("budgets"))
    arr = np.asarray(data, dtype=np.float64)
    if arr.ndim != 2 or arr.size == 0 or (arr <= 0).all():
        raise ValueError(f"{path}: expected [layers][KV heads] positive budgets")
    return np.maximum(arr, 1.0)


class Timer:
    """Seconds per call of ``fn(i)`` (i cycles over the page copies)."""

    def __init__(self, device: torch.device, reps: int, trials: int, copies: int) -> None:
        self.device, self.reps, self.trials, self.copies = device, reps, trials, copies

    def __call__(self, fn: Callable[[int], object]) -> float:
        for i in range(self.copies):  # compile and warm up outside any capture
            fn(i)
        if self.device.type != "cuda":
            samples = []
            for t in range(self.trials):
                start = time.perf_counter()
                for i in range(self.reps):
                    fn(i % self.copies)
                samples.append((time.perf_counter() - start) / self.reps)
            return statistics.median(samples)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.reps):
                fn(i % self.copies)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # first replay uploads the graph
        samples = []
        for _ in range(self.trials):
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3 / self.reps)
        return statistics.median(samples)


# Resident programs per SM of the paged decode kernel at D=128 on an H200 (paged_decode.py).
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256


def ragged_num_splits(lengths: list[int], batch: int, num_sms: int) -> int:
    """Flash-decoding splits for rows of unequal length: about one wave of programs with
    work, each ~total / slots tokens; rounded up to a power of two (few kernel variants).

    The kernel's default (``choose_num_splits``) sizes splits for rows of equal length: with
    one long head among short ones, its few splits leave the long head's programs running
    alone, and a group's time follows its longest head instead of its total work. Programs
    of a split past a row's end exit at once, so many splits cost little for short rows.
    """
    slots = _PROGRAMS_PER_SM * num_sms
    chunk = max(_MIN_TOKENS_PER_SPLIT, -(-batch * sum(lengths) // slots))
    return min(1024, 1 << (-(-max(lengths) // chunk) - 1).bit_length())


class SparseLayer:
    """Paged K/V for every (request, KV head) up to the longest read, in ``copies`` disjoint
    page sets; ``time(heads, lengths)`` times one head group of one layer."""

    def __init__(self, args, max_tokens: int, timer: Timer, device: torch.device, dtype: torch.dtype) -> None:
        B, Hkv, D, S = args.batch, args.kv_heads, args.head_dim, args.page_size
        self.G, self.timer, self.args = args.heads // Hkv, timer, args
        P = -(-max_tokens // S)
        n_pages = args.copies * B * Hkv * P
        self.k_pages = torch.randn(n_pages, S, D, device=device, dtype=dtype)
        self.v_pages = torch.randn(n_pages, S, D, device=device, dtype=dtype)
        # Copy c, request b, head h: pages (c*B*Hkv + b*Hkv + h) * P + shuffled 0 .. P-1.
        base = torch.arange(args.copies * B * Hkv, device=device).view(args.copies, B, Hkv, 1) * P
        within = torch.argsort(torch.rand(args.copies, B, Hkv, P, device=device), dim=-1)
        self.block_tables = (base + within).to(torch.int32)  # [copies, B, Hkv, P]
        self.q = torch.randn(B, args.heads, D, device=device, dtype=dtype)
        self.decode = paged_decode.paged_decode_attention if device.type == "cuda" else paged_decode.paged_decode_attention_ref
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4

    def time(self, heads: tuple[int, ...], lengths: list[int]) -> float:
        """heads: KV head ids; lengths: [Hkv] tokens read per KV head in this layer."""
        if not heads:
            return 0.0
        B, G = self.args.batch, self.G
        idx = torch.tensor(heads, device=self.q.device)
        q_idx = (idx[:, None] * G + torch.arange(G, device=self.q.device)).reshape(-1)
        q = self.q[:, q_idx].contiguous()  # [B, n*G, D]
        tables = self.block_tables[:, :, idx].contiguous()  # [copies, B, n, P]
        seq_lens = torch.tensor([lengths[h] for h in heads], dtype=torch.int32, device=q.device).expand(B, -1).contiguous()
        out = torch.empty_like(q)
        kw = {}
        if self.decode is paged_decode.paged_decode_attention:
            group_lengths = [lengths[h] for h in heads]
            kw["max_seq_len"] = max(group_lengths)
            if self.args.splits == "ragged":
                kw["num_splits"] = ragged_num_splits(group_lengths, B, self.num_sms)
        return self.timer(lambda c: self.decode(q, self.k_pages, self.v_pages, tables[c], seq_lens, out=out, **kw))


def dense_time(args, timer: Timer, device: torch.device, dtype: torch.dtype, kv_head_counts: list[int]) -> dict[int, float]:
    """SDPA over the whole context for the first n KV heads (GQA as a G-long query per KV
    head), for each n; -> {n: seconds}."""
    B, Hkv, D, T = args.batch, args.kv_heads, args.head_dim, args.context
    G = args.heads // Hkv
    k = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
    q = torch.randn(B, Hkv, G, D, device=device, dtype=dtype)
    sdpa = torch.nn.attention.SDPBackend
    any_backend = [sdpa.FLASH_ATTENTION, sdpa.CUDNN_ATTENTION, sdpa.EFFICIENT_ATTENTION, sdpa.MATH]
    backends = [sdpa.FLASH_ATTENTION] if device.type == "cuda" else any_backend
    try:
        with torch.nn.attention.sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, k, v)
    except RuntimeError as e:  # no flash kernel for this shape or build: let torch choose
        print(f"flash SDPA unavailable ({e}); timing torch's default SDPA backend", flush=True)
        backends = any_backend
    out = {}
    for n in kv_head_counts:
        def run(_c: int, n=n):
            with torch.nn.attention.sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q[:, :n], k[:, :n], v[:, :n])
        out[n] = timer(run)
    return out  # k and v are freed here, before the sparse pages are allocated


def makespan_s(placement: HeadPlacement, lengths: list[list[int]], sparse: SparseLayer, cache: dict) -> tuple[float, list[list[float]]]:
    """(sum over layers of the slowest rank's time, [L][R] times); group timings are cached."""
    per_layer = []
    for layer in range(placement.num_layers):
        row = []
        for heads in (placement.kv_heads_of(r)[layer] for r in range(placement.num_ranks)):
            key = (layer, heads)
            if key not in cache:
                cache[key] = sparse.time(heads, lengths[layer])
            row.append(cache[key])
        per_layer.append(row)
    return sum(max(row) for row in per_layer), per_layer


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=32, help="decode requests B")
    add_shape(ap, page_size=16, layers=True)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--mean-budget", type=int, default=2048, help="mean middle budget per KV head, tokens")
    ap.add_argument("--budgets", default=None, help="JSON [L][Hkv] budgets to stretch (default: synthetic)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the synthetic profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--splits", choices=("ragged", "default"), default="ragged",
                    help="flash-decoding splits: sized by the group's total work, or the kernel's default")
    add_device(ap, default="cuda")
    add_out(ap, md=True)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu for a (tiny) smoke run")
    if args.heads % args.kv_heads or max(args.ranks) > args.kv_heads:
        raise ValueError("--heads must be a multiple of --kv-heads, and every rank count <= --kv-heads")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    fixed = args.sink + args.local
    if args.budgets:
        needs, source = stretch_budgets(load_budgets(args.budgets), args.layers, args.kv_heads), f"file {args.budgets}"
    else:
        needs = synthetic_budgets(args.layers, args.kv_heads, args.sigma, args.seed)
        source = f"synthetic lognormal(sigma={args.sigma}, seed={args.seed})"
    budgets = scale_budgets(needs, args.mean_budget, args.page_size, args.context - fixed)
    lengths = [[min(args.context, fixed + b) for b in row] for row in budgets]  # tokens read per KV head
    G = args.heads // args.kv_heads
    costs = head_costs(budgets, sink_tokens=args.sink, local_tokens=args.local, num_kv_groups=G, context_tokens=args.context)

    timer = Timer(device, args.reps, args.trials, args.copies)
    counts = sorted({args.kv_heads} | {-(-args.kv_heads // r) for r in args.ranks})
    dense = dense_time(args, timer, device, dtype, counts)
    sparse = SparseLayer(args, max(max(row) for row in lengths), timer, device, dtype)
    cache: dict = {}
    uniform = [args.mean_budget + fixed] * args.kv_heads
    all_heads = tuple(range(args.kv_heads))
    one_gpu_s = sum(sparse.time(all_heads, lengths[layer]) for layer in tqdm(range(args.layers), desc="1 GPU"))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {k: getattr(args, k) for k in ("context", "batch", "layers", "heads", "kv_heads", "head_dim", "page_size", "sink", "local", "splits")},
        "budgets": {"source": source, "mean": float(np.mean(budgets)), "min": int(np.min(budgets)), "max": int(np.max(budgets)), "per_head": budgets},
        "dense_step_s": args.layers * dense[args.kv_heads],
        "sparse_one_gpu_step_s": one_gpu_s,
        # Attention-only bound: dense bytes over the bytes the budgets read.
        "bytes_bound": args.layers * args.kv_heads * args.context / sum(map(sum, lengths)),
        "ranks": [],
    }
    result["sparse_speedup"] = result["dense_step_s"] / one_gpu_s
    for R in tqdm(args.ranks, desc="ranks"):
        contiguous, greedy = contiguous_placement(costs, R), greedy_placement(costs, R)
        t_cont, _ = makespan_s(contiguous, lengths, sparse, cache)
        t_greedy, greedy_layers = makespan_s(greedy, lengths, sparse, cache)
        # Uniform budgets of the same mean: every contiguous group alike, rank 0's the largest.
        t_uniform = args.layers * sparse.time(contiguous.kv_heads_of(0)[0], uniform)
        result["ranks"].append({
            "num_ranks": R,
            "dense_makespan_s": args.layers * dense[-(-args.kv_heads // R)],
            "contiguous_makespan_s": t_cont,
            "greedy_makespan_s": t_greedy,
            "measured_gain": t_cont / t_greedy,
            "model_gain": contiguous.makespan / greedy.makespan,
            "contiguous_imbalance": contiguous.imbalance,
            "greedy_imbalance": greedy.imbalance,
            "greedy_bubble_ratio": bubble_ratio(list(zip(*greedy_layers))),
            "uniform_budget_makespan_s": t_uniform,
            "speedup_vs_dense": args.layers * dense[-(-args.kv_heads // R)] / t_greedy,
            "greedy_placement": greedy.to_dict()["kv_head_to_rank"],
        })
    _report(result, args)
    return result


def _report(result: dict, args) -> None:
    ms = 1e3
    lines = [
        f"{result['device']} | B={args.batch} T={args.context} L={args.layers} H={args.heads} Hkv={args.kv_heads} "
        f"D={args.head_dim} S={args.page_size} splits={args.splits} | budgets: {result['budgets']['source']}, mean "
        f"{result['budgets']['mean']:.0f} (min {result['budgets']['min']}, max {result['budgets']['max']}) + "
        f"sink {args.sink} + local {args.local}",
        "",
        f"one GPU, all heads, per step (L layers): dense {result['dense_step_s'] * ms:.2f} ms, "
        f"S-HPLB sparse {result['sparse_one_gpu_step_s'] * ms:.2f} ms -> {result['sparse_speedup']:.2f}x "
        f"(bytes bound {result['bytes_bound']:.1f}x, Select not timed)",
        "",
        "| ranks | dense ms | uniform-budget ms | contiguous ms | greedy ms | gain (measured) | gain (cost model) "
        "| imbalance contiguous -> greedy | greedy bubble | greedy vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["ranks"]:
        lines.append(
            f"| {r['num_ranks']} | {r['dense_makespan_s'] * ms:.2f} | {r['uniform_budget_makespan_s'] * ms:.2f} | "
            f"{r['contiguous_makespan_s'] * ms:.2f} | {r['greedy_makespan_s'] * ms:.2f} | {r['measured_gain']:.2f}x | "
            f"{r['model_gain']:.2f}x | {r['contiguous_imbalance']:.2f} -> {r['greedy_imbalance']:.2f} | "
            f"{r['greedy_bubble_ratio']:.2f} | {r['speedup_vs_dense']:.2f}x |"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    save(args, result)


if __name__ == "__main__":
    main()
