"""Where an engine step's time goes (not a test): wall time per step, then the torch
profiler's top operators by device and by host time.

    python benchmarks/profile_engine.py [--model DIR] [--prompts 35] [--length 4096]
                                        [--algorithm dense|quest|...] [--budget 256]
                                        [--max-batched-tokens 2048] [--max-tokens 16] [--out JSON]

Runs ``--prompts`` synthetic prompts of ``--length`` tokens to completion (greedy, exactly
``--max-tokens`` new tokens each), timing every step, and profiles the last few prefill and
decode steps. ``dense`` runs on the GPU-only paged cache, every other algorithm on the
offloaded one, as ``spin-cluster eval`` does.
"""

from __future__ import annotations

import argparse
import time

from spin_cluster.bench.args import add_algorithm, add_device, add_model, add_out, model_path, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model(ap)
    ap.add_argument("--prompts", type=int, default=35)
    ap.add_argument("--length", type=int, default=4096)
    add_algorithm(ap, default="dense", choices=None, help="sparse.algorithm (dense: the GPU-only paged cache)")
    ap.add_argument("--budget", type=float, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16)
    add_device(ap, default="auto")
    ap.add_argument("--rows", type=int, default=25, help="operators listed per table")
    add_out(ap, help="write the step times and the top operators as JSON here")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine.engine import Engine
    from spin_cluster.engine.request import SamplingParams

    path = model_path(args)
    dense = args.algorithm == "dense"
    sparse = {"algorithm": args.algorithm} if dense else {"algorithm": args.algorithm, "budget": args.budget}
    config = SpinConfig.from_dict({
        "model": {"path": path, "device": args.device, "max_model_len": args.length + args.max_tokens},
        "cache": {"kind": "paged" if dense else "offloaded"},
        "scheduler": {"max_num_seqs": args.prompts, "max_num_batched_tokens": args.max_batched_tokens},
        "sparse": sparse,
    })
    engine = Engine(config)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0)
    for i in range(args.prompts):
        engine.add_request([1 + (i * 7919 + j * 31) % (vocab - 1) for j in range(args.length)], params)

    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    times, kinds, prof = [], [], None
    while engine.has_unfinished():
        running = engine.scheduler.running
        decode_only = not engine.scheduler.waiting and all(
            r.num_computed_tokens >= len(r.prompt_token_ids) for r in running)
        profiled = prof is None and decode_only and len(times) > 2
        sync()
        t0 = time.perf_counter()
        if profiled:
            with profile(activities=activities) as prof:
                engine.step()
                sync()
        else:
            engine.step()
            sync()
        times.append(time.perf_counter() - t0)
        kinds.append("decode" if decode_only else "prefill")
    result = {"model": path, "algorithm": args.algorithm, "prompts": args.prompts, "length": args.length,
              "max_tokens": args.max_tokens, "steps": {}, "top_by_device": [], "top_by_host": []}
    for kind in ("prefill", "decode"):
        ts = [t for t, k in zip(times, kinds) if k == kind]
        if ts:
            print(f"{kind}: {len(ts)} steps, {1e3 * sum(ts) / len(ts):.1f} ms/step mean, {sum(ts):.2f} s in all")
            result["steps"][kind] = {"steps": len(ts), "mean_s": sum(ts) / len(ts), "total_s": sum(ts)}
    if prof is not None:
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        # key_averages' rows name the device time device_time_total (cuda_time_total only sorts).
        result["top_by_device"] = top_ops(prof, "device_time_total" if cuda else "cpu_time_total", args.rows)
        result["top_by_host"] = top_ops(prof, "self_cpu_time_total", args.rows)
    save(args, result)


def top_ops(prof, key: str, rows: int) -> list[dict]:
    """The profiler's ``rows`` operators with the most ``key`` time (microseconds, as it counts)."""
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:rows]
    return [{"name": e.key, "calls": e.count, key + "_us": getattr(e, key)} for e in events]


if __name__ == "__main__":
    main()
