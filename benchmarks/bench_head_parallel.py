"""Head-parallel decode on the GPUs of one host: per-rank attention time, bubble ratio, decode
step time and speed-up over one GPU, contiguous vs greedy placement, same run (not a test).

    python benchmarks/bench_head_parallel.py [--ranks 1 2 4 8] [--context 131072] [--batch 2]
                                             [--steps 32] [--budget 2048] [--out r.json --md r.md]
    python benchmarks/bench_head_parallel.py --tiny      # CPU, gloo ranks, toy shapes

The engine is the S-HPLB head-parallel engine itself (``spin_cluster.parallel``): one process
per GPU, NCCL (NVLink multicast left off: ``NCCL_NVLS_ENABLE=0``), Llama-3.1-8B shapes with
random bf16 weights (32 layers, 32/8 heads, d=128), Spin's offloaded cache with Quest
selection and S-HPLB per-head budgets (seeded log-normal needs, max-min shifted to a mean of
``--budget`` tokens per head: random weights have no profile). Every rank count runs the same
``--batch`` prompts of ``--context`` tokens, greedy, ``--steps`` decode steps, under the
contiguous and the greedy placement of those budgets; 1 rank is the one-GPU baseline.

Per configuration, over the decode steps only (prefill excluded): the median step time, each
rank's attention seconds per step, the bubble (per layer, slowest rank minus the mean, summed)
and its ratio to the attention critical path, the speed-up of the step over one GPU, and
whether the tokens equal the one-GPU run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from spin_cluster.bench.args import add_budget_tokens, add_out, add_tokenizer, save

# --tiny: Llama-3.1-8B's config (spin_cluster.models.shapes) with these fields replaced.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 49152, "max_position_embeddings": 4096,
        "rope_scaling": None}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes, gloo ranks on the CPU (smoke test)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="rank counts (those above the GPUs present are skipped)")
    ap.add_argument("--context", type=int, default=131072, help="prompt tokens per request")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    add_budget_tokens(ap, help="mean middle tokens per KV head (S-HPLB shifted)")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32 makes the token check exact: bf16 logits of random weights are near ties")
    ap.add_argument("--max-batched-tokens", type=int, default=65536, help="prefill chunk (tokens per step)")
    ap.add_argument("--gpu-kv-gib", type=float, default=24.0)
    ap.add_argument("--host-kv-gib", type=float, default=40.0)
    add_tokenizer(ap)
    ap.add_argument("--timeout-s", type=float, default=480.0,
                    help="per configuration, counted once every rank has started")
    add_out(ap, md=True)
    args = ap.parse_args(argv)
    if args.tiny:
        args.ranks = [r for r in args.ranks if r <= 2] or [1, 2]
        args.context, args.batch, args.steps, args.budget, args.page_size = 96, 2, 6, 8, 4
        args.gpu_kv_gib, args.host_kv_gib = 0.01, 0.01
    return args


# ---- rank 0 --------------------------------------------------------------------------------------


def _lead(prompts, steps: int, device_type: str, engine) -> dict:
    """Rank 0's run (``run_rank``'s lead; the workers run its plans): every decode step timed."""
    import torch

    from spin_cluster.engine import SamplingParams

    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    decode = []  # (step s, [R] attention s, bubble s)
    t0 = time.perf_counter()
    prefill_s = None
    while engine.has_unfinished():
        decode_only = not engine.scheduler.waiting and all(
            r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)
        if decode_only and prefill_s is None:
            prefill_s = time.perf_counter() - t0
        sync()
        start = time.perf_counter()
        outs = engine.step()
        sync()
        st = engine.last_stats
        if decode_only:
            decode.append((time.perf_counter() - start, list(st.attention_rank_s), st.attention_bubble_s))
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
    graphs = engine.runner.graphs
    return {"placement": engine.placement.to_dict(), "prefill_s": prefill_s, "decode": decode,
            "tokens": [tokens[i] for i in ids], "graph_replays": graphs.replays if graphs else 0}


def run_config(config, placement, prompts, steps: int, num_ranks: int, device_type: str, timeout_s: float) -> dict:
    """Spawn ``num_ranks`` rank processes, run, and return rank 0's report."""
    import functools

    from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS
    from spin_cluster.parallel.group import free_port
    from spin_cluster.parallel.launch import run_rank, run_ranks

    lead = functools.partial(_lead, prompts, steps, device_type)
    args = (num_ranks, free_port(), device_type, config, placement, lead, ADMISSION_OUTPUT_TOKENS)
    return run_ranks(run_rank, args, num_ranks, timeout_s)[0]


# ---- the sweep -----------------------------------------------------------------------------------


def summarize(report: dict, baseline_step_s: float | None, baseline_tokens) -> dict:
    from spin_cluster.hplb.placement import HeadPlacement

    steps = report["decode"][1:]  # the first decode step pays one-off costs (Triton, allocator)
    if not steps:
        raise RuntimeError("no decode step was timed: raise --steps")
    step_s = statistics.median(s for s, _, _ in steps)
    num_ranks = len(steps[0][1])
    rank_s = [statistics.mean(r[i] for _, r, _ in steps) for i in range(num_ranks)]
    bubble_s = statistics.mean(b for _, _, b in steps)
    critical = bubble_s + statistics.mean(rank_s)
    return {
        "ranks": num_ranks, "prefill_s": report["prefill_s"], "decode_step_s": step_s,
        "attention_rank_s": rank_s, "attention_makespan_s": critical, "bubble_s": bubble_s,
        "bubble_ratio": bubble_s / critical if critical > 0 else 0.0,
        "imbalance": HeadPlacement.from_dict(report["placement"]).imbalance,  # of the cost model
        "speedup_vs_1": baseline_step_s / step_s if baseline_step_s else None,
        "tokens_equal_1": None if baseline_tokens is None else report["tokens"] == baseline_tokens,
        "graph_replays": report.get("graph_replays", 0), "decode_steps": len(report["decode"]),
    }


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"{result['device']}; {a.get('dtype', 'bfloat16')}, context {a['context']}, batch {a['batch']}, "
             f"{a['steps']} decode steps, mean budget {a['budget']} tokens/head (S-HPLB, synthetic needs), "
             f"page {a['page_size']}", "",
             "| ranks | placement | decode step ms | speed-up vs 1 | attention makespan ms | per-rank attention ms "
             "| bubble ratio | cost-model imbalance | tokens = 1 GPU | graph replays |",
             "|---:|---|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['ranks']} | {r['placement']} | failed: {r['error']} | | | | | | | |")
            continue
        per_rank = " / ".join(f"{1e3 * s:.2f}" for s in r["attention_rank_s"])
        speed = "-" if r["speedup_vs_1"] is None else f"{r['speedup_vs_1']:.2f}x"
        same = "-" if r["tokens_equal_1"] is None else ("yes" if r["tokens_equal_1"] else "**no**")
        lines.append(f"| {r['ranks']} | {r['placement']} | {1e3 * r['decode_step_s']:.2f} | {speed} "
                     f"| {1e3 * r['attention_makespan_s']:.2f} | {per_rank} | {r['bubble_ratio']:.3f} "
                     f"| {r.get('imbalance') or 0:.3f} | {same} "
                     f"| {r.get('graph_replays', 0)}/{r.get('decode_steps', 0)} |")
    for n, g in result.get("greedy_vs_contiguous", {}).items():
        lines.append(f"\n{n} ranks: greedy makespan {g['makespan_gain']:.2f}x lower than contiguous "
                     f"(cost model: {g['model_gain']:.2f}x); "
                     f"bubble ratio {g['bubble_contiguous']:.3f} -> {g['bubble_greedy']:.3f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import shutil

    import torch

    from spin_cluster.config import SpinConfig
    from spin_cluster.hplb.budget import synthetic_maxmin_budgets
    from spin_cluster.models import ModelConfig
    from spin_cluster.models.shapes import LLAMA_31_8B, shape_folder
    from spin_cluster.parallel import default_placement

    on_gpu = torch.cuda.is_available() and not args.tiny
    device_type = "cuda" if on_gpu else "cpu"
    gpus = torch.cuda.device_count() if on_gpu else 2
    ranks = sorted({r for r in args.ranks if 1 <= r <= gpus} | {1})
    skipped = sorted(set(args.ranks) - set(ranks))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    shape = {**LLAMA_31_8B, **TINY} if args.tiny else LLAMA_31_8B
    max_len = args.context + args.steps + 2 * args.page_size
    folder = shape_folder(shape, max_len, args.tokenizer, prefix="hp-model-")
    L, hkv = shape["num_hidden_layers"], shape["num_key_value_heads"]
    budgets = synthetic_maxmin_budgets(L, hkv, args.budget, args.page_size)
    config = SpinConfig.from_dict({
        "model": {"path": folder, "load_format": "dummy", "max_model_len": max_len,
                  **({"device": "cpu", "dtype": "float32"} if args.tiny else {"dtype": args.dtype})},
        "cache": {"kind": "offloaded", "page_size": args.page_size, "kv_cache_gib": args.gpu_kv_gib,
                  "host_kv_gib": args.host_kv_gib},
        "scheduler": {"max_num_seqs": args.batch, "max_num_batched_tokens": 64 if args.tiny else args.max_batched_tokens},
        "sparse": {"algorithm": "quest", "budget": args.budget, "sink_tokens": args.page_size,
                   "local_tokens": 2 * args.page_size, "options": {"per_head_budgets": budgets}},
    })
    mc = ModelConfig.from_folder(folder)
    prompts = [[1000 + (7 * i + j) % 30000 for j in range(args.context)] for i in range(args.batch)]
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu (gloo)", "num_gpus": gpus if on_gpu else 0,
              "args": vars(args), "budgets": budgets, "skipped_ranks": skipped, "runs": []}
    base_step = base_tokens = None
    for n in ranks:
        for method in (("contiguous", "greedy") if n > 1 else ("one GPU",)):
            placement = default_placement(config, mc, n, "greedy" if n == 1 else method)
            t0 = time.monotonic()
            try:
                report = run_config(config, placement, prompts, args.steps, n, device_type, args.timeout_s)
            except (RuntimeError, TimeoutError) as e:  # one failed configuration does not end the sweep
                if n == 1:
                    raise
                row = {"ranks": n, "placement": method, "error": f"{type(e).__name__}: {e}"[:300],
                       "wall_s": time.monotonic() - t0}
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
                _write(result, args)
                continue
            row = {"placement": method, **summarize(report, base_step, base_tokens), "wall_s": time.monotonic() - t0}
            if n == 1:
                base_step, base_tokens = row["decode_step_s"], report["tokens"]
                row["speedup_vs_1"], row["tokens_equal_1"] = 1.0, True
            result["runs"].append(row)
            print(json.dumps({k: row[k] for k in ("ranks", "placement", "decode_step_s", "attention_makespan_s",
                                                  "bubble_ratio", "speedup_vs_1", "tokens_equal_1", "wall_s")}),
                  flush=True)
            _write(result, args)  # what is done so far survives a run cut short
    shutil.rmtree(folder, ignore_errors=True)
    table = _write(result, args)
    print(table)
    return result


def _write(result: dict, args) -> str:
    """Add the greedy-vs-contiguous ratios of the rank counts run so far; write --out and --md."""
    by = {(r["ranks"], r["placement"]): r for r in result["runs"] if "error" not in r}
    result["greedy_vs_contiguous"] = {
        str(n): {"makespan_gain": by[n, "contiguous"]["attention_makespan_s"] / by[n, "greedy"]["attention_makespan_s"],
                 # the same ratio as the cost model predicts it (equal means: the imbalances give it)
                 "model_gain": (1 + by[n, "contiguous"]["imbalance"]) / (1 + by[n, "greedy"]["imbalance"]),
                 "bubble_contiguous": by[n, "contiguous"]["bubble_ratio"], "bubble_greedy": by[n, "greedy"]["bubble_ratio"]}
        for n in sorted({n for n, _ in by}) if (n, "contiguous") in by and (n, "greedy") in by
    }
    table = markdown(result)
    save(args, result)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
