"""Where an engine step's time goes (not a test): wall time per step, then the torch
profiler's top operators by device and by host time.

    python benchmarks/profile_engine.py [--model DIR] [--prompts 35] [--length 4096]
                                        [--algorithm dense|quest|...] [--budget 256]
                                        [--max-batched-tokens 2048] [--max-tokens 16]

Runs ``--prompts`` synthetic prompts of ``--length`` tokens to completion (greedy, exactly
``--max-tokens`` new tokens each), timing every step, and profiles the last few prefill and
decode steps. ``dense`` runs on the GPU-only paged cache, every other algorithm on the
offloaded one, as ``spin-cluster eval`` does.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the prepared default model)")
    ap.add_argument("--prompts", type=int, default=35)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--algorithm", default="dense")
    ap.add_argument("--budget", type=float, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rows", type=int, default=25, help="operators listed per table")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine.engine import Engine
    from spin_cluster.engine.request import SamplingParams
    from spin_cluster.model_store import prepare_default_model

    path = args.model or str(prepare_default_model())
    dense = args.algorithm == "dense"
    sparse = {"algorithm": args.algorithm} if dense else {"algorithm": args.algorithm, "budget": args.budget}
    config = SpinConfig.from_dict({
        "model": {"path": path, "device": args.device, "max_model_len": args.length + args.max_tokens},
        "cache": {"offload": not dense},
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
    for kind in ("prefill", "decode"):
        ts = [t for t, k in zip(times, kinds) if k == kind]
        if ts:
            print(f"{kind}: {len(ts)} steps, {1e3 * sum(ts) / len(ts):.1f} ms/step mean, {sum(ts):.2f} s in all")
    if prof is not None:
        key = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
