"""Where a decode step's time goes: wall time of the step as served (CUDA graph replay where
the engine has one), the GPU kernels of the same step run eagerly, grouped by kernel, and the
host time around the model (scheduling, sampling, stats).

    python benchmarks/profile_step.py --mode spin --context 32768 --batch 4      # CUDA
    python benchmarks/profile_step.py --tiny --mode spin                           # CPU smoke test

The engine is ``benchmarks/e2e.py``'s for the mode (``--shape``'s shapes, random weights); the
batch's prompts are prefilled, then ``--warmup`` decode steps capture the graphs, then
``--steps`` decode steps are timed as served and one more runs eagerly under
``torch.profiler``. With ``--mixed N``, one more prompt of N tokens then arrives and the steps
that prefill it beside the running batch (mixed steps, always eager) are timed and profiled:
what a prompt costs a loaded server, spills included when the GPU is full. With ``--drain
N``, N requests then end one at a time and each new batch size's first steps are timed (a
Spin batch runs in the smallest captured graph that holds it, padded, or eagerly where none
does), the last size's
first step profiled. The served steps also give the host's time on the critical path: the
GPU's idle time between one step's sampling and the next step's launch (CUDA events).
Output: a table on stdout and ``profile-<mode>-<context>.json`` in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder: the modes and the model folder)

from profile_tools import (  # noqa: E402  (same folder)
    host_profile, host_rows, kernel_part, kernel_rows, print_gaps, print_host, profiled,
)
from spin_cluster.bench.args import add_out_folder, write_result  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=e2e.MODES, default="spin")
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens of every request")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="then prefill one more prompt of N tokens beside the batch, timed and profiled")
    ap.add_argument("--drain", type=int, default=0, metavar="N",
                    help="then end N requests of the batch one at a time (abort): each new batch size's first "
                         "steps timed, and the first step of the last size profiled")
    ap.add_argument("--tiny", action="store_true")
    add_out_folder(ap)
    e2e.add_engine_args(ap)  # the engine's settings, as e2e.py
    args = ap.parse_args(argv)
    if args.tiny:
        args.gpu_kv_gib, args.host_kv_gib, args.context, args.batch = 0.002, 0.05, 256, 2
        args.budget, args.page_size, args.max_num_seqs, args.max_batched_tokens = 64, 16, 4, 256
        args.steps, args.warmup = 3, 1
        args.mixed = min(args.mixed, 128)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    e2e._import_package()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.models.shapes import SHAPES, shape_folder, tiny

    shape = tiny(SHAPES[args.shape], e2e.TINY) if args.tiny else SHAPES[args.shape]
    # Every request still decodes in the profiled, eager and mixed steps, and the first ones to
    # be prefilled decode through the rest of the batch's prefill (a prompt takes up to
    # ceil(context / max_batched_tokens) + 1 steps beside the decode rows): none may finish
    # before the timed steps, or the batch measured is smaller than the one asked for.
    prefill_steps = args.batch * (-(-args.context // args.max_batched_tokens) + 1)
    total = prefill_steps + args.warmup + args.steps + 4 + (8 if args.mixed else 0) + 3 * args.drain
    max_len = args.context + total + args.page_size
    folder = shape_folder(shape, max_len, args.tokenizer, prefix="profile-model-")
    engine = Engine(SpinConfig.from_dict(e2e.mode_config(args.mode, args, folder, max_len, shape)), progress=False,
                    buffer_policy=e2e.mode_buffer_policy(args.mode, args))
    cuda = engine.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(engine.device)

    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([1000 + (7 * i + j) % 30000 for j in range(args.context)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    sync()
    batch = engine.last_stats.num_running
    # As served: whole engine steps, and the runner's part of them.
    runner = engine.runner
    execute = runner.execute
    runner_s: list[float] = []

    piped = engine.async_decode  # pipelined decode: the runner returns before its step ends

    def timed_execute(chunks, *a):
        t0 = time.perf_counter()
        out = execute(chunks, *a)
        if not piped:
            sync()
        runner_s.append(time.perf_counter() - t0)
        return out

    runner.execute = timed_execute
    # The graph's own GPU span in each served step: CUDA events around the graph's run (input
    # copies and replay), against the runner's wall time it separates the gaps between the
    # graph's kernels from the host's time around it.
    graphs_run = getattr(runner.graphs, "run", None)
    replay_events: list = []

    def timed_run(*a, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = graphs_run(*a, **kw)
        end.record()
        replay_events.append((start, end))
        return out

    if cuda and graphs_run is not None:
        runner.graphs.run = timed_run
    # The host's time on the critical path: how long the GPU sits idle between one served step's
    # last operation and the next one's first, waiting for the host to enqueue it. CUDA events
    # at the start of each step's launch (before its input copy) and after its sampling and
    # token copy: the GPU reaches the next start event at once when the host is ahead of it
    # (pipelined decode), or only when the host gets there.
    launch = engine._launch
    marks: list[tuple] = []

    def marked_launch(*a, **kw):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = launch(*a, **kw)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks.append((start, end))
        return out

    if cuda and piped:
        engine._launch = marked_launch
    step_s = []
    for _ in range(args.steps):
        if not piped:
            sync()
        t0 = time.perf_counter()
        engine.step()
        if not piped:  # else back to back, as served: each call returns when its tokens are read
            sync()
        step_s.append(time.perf_counter() - t0)
    sync()
    engine._launch = launch
    host_gap_s = [marks[i][1].elapsed_time(marks[i + 1][0]) / 1e3 for i in range(len(marks) - 1)]
    runner.execute = execute
    if graphs_run is not None:
        runner.graphs.run = graphs_run
    replay_s = statistics.median(s.elapsed_time(e) / 1e3 for s, e in replay_events) if replay_events else None
    # One step as served (graph replay) under the profiler: the GPU's span from its first
    # kernel's start to its last one's end, against the kernels' own time (the rest: gaps
    # between kernels, which a graph shrinks but does not remove).
    replay = None
    if cuda and runner.graphs is not None:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        spans = [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
                 if ev.device_type.name == "CUDA" and getattr(ev, "device_time", 0)]
        if spans:
            replay = {"kernels": len(spans), "kernel_s": sum(e - b for b, e in spans) / 1e6,
                      "span_s": (max(e for _, e in spans) - min(b for b, _ in spans)) / 1e6}
    # One step eagerly under the profiler: its kernels, by name.
    graphs, runner.graphs = runner.graphs, None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.step()
        sync()
    eager_profiled_s = time.perf_counter() - t0
    runner.graphs = graphs
    sync()
    t0 = time.perf_counter()
    with host_profile() as py:
        engine.step()  # eager again, without torch.profiler's overhead (cProfile's is small)
        sync()
    eager_s = time.perf_counter() - t0
    rows = kernel_rows(prof, cuda)
    gpu_s = sum(t for _, t, _ in rows)
    layers = engine.kv.num_layers
    parts = {}
    for name, t, n in rows:
        part = parts.setdefault(kernel_part(name), {"ms_per_step": 0.0, "kernels_per_layer": 0.0})
        part["ms_per_step"] += 1e3 * t
        part["kernels_per_layer"] += n / layers
    result = {
        "mode": args.mode, "context": args.context, "batch": batch, "device": str(engine.device),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "graphs": type(graphs).__name__ if graphs is not None else None,
        "graph_replays": getattr(graphs, "replays", None),
        "async_decode": piped, "step_s_median": statistics.median(step_s), "runner_s_median": statistics.median(runner_s),
        "host_gap_s_median": statistics.median(host_gap_s) if host_gap_s else None,
        "host_gap_s_max": max(host_gap_s) if host_gap_s else None,
        "eager_step_s": eager_s, "eager_profiled_step_s": eager_profiled_s,
        "replay": replay, "graph_gpu_s": replay_s,
        "kernel_s_sum": gpu_s, "num_kernels": sum(n for *_, n in rows),
        "kernels_per_layer": sum(n for *_, n in rows) / layers, "parts": parts,
        "top": [{"name": n[:120], "s": t, "calls": c} for n, t, c in rows[: args.top]],
        "host_ops": host_rows(prof), "eager_python": py.text,
        "hit_ratio": (engine.last_stats.buffer_hits_total / engine.last_stats.buffer_lookups_total
                      if engine.last_stats.buffer_lookups_total else None),
    }
    if args.mixed:
        result["mixed"] = mixed_prompt(engine, args.mixed, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                       sync, cuda, layers)
    if args.drain:
        result["drain"] = drain(engine, args.drain, sync, cuda)
    write_result(os.path.join(args.out, f"profile-{args.mode}-{args.context}.json"), result)
    print(f"{args.mode} context {args.context} batch {batch} on {result['gpu']}: step {1e3 * result['step_s_median']:.2f} ms "
          f"as served (runner {1e3 * result['runner_s_median']:.2f} ms{', launch only: pipelined' if piped else ''}, graphs: {result['graphs']}), "
          f"eager {1e3 * eager_s:.2f} ms; kernels of one eager step: {result['num_kernels']} taking "
          f"{1e3 * gpu_s:.2f} ms; buffer hit ratio {result['hit_ratio']}")
    if replay_s is not None:
        print(f"graph run on the GPU: {1e3 * replay_s:.2f} ms per served step (CUDA events around it)")
    if host_gap_s:
        print(f"host on the critical path: the GPU idle {1e3 * result['host_gap_s_median']:.3f} ms between served steps "
              f"(median of {len(host_gap_s)}, max {1e3 * result['host_gap_s_max']:.3f}; CUDA events)")
    if replay:
        print(f"graph replay: {replay['kernels']} kernels taking {1e3 * replay['kernel_s']:.2f} ms over a GPU span of "
              f"{1e3 * replay['span_s']:.2f} ms")
    print_host(result["host_ops"], result["eager_python"], "one eager step")
    print("| part | ms per step | kernels per layer |\n|---|---:|---:|")
    for name, part in sorted(parts.items(), key=lambda kv: -kv[1]["ms_per_step"]):
        print(f"| {name} | {part['ms_per_step']:.3f} | {part['kernels_per_layer']:.1f} |")
    print("| kernel | ms per step | calls |\n|---|---:|---:|")
    for r in result["top"]:
        print(f"| {r['name'][:90]} | {1e3 * r['s']:.3f} | {r['calls']} |")
    if args.mixed:
        m = result["mixed"]
        print(f"mixed: a {args.mixed}-token prompt beside {batch} decoding requests took {m['steps']} steps, "
              f"{1e3 * m['wall_s']:.1f} ms of wall time ({1e3 * m['profiled_wall_s']:.1f} ms profiled); kernels "
              f"{1e3 * m['kernel_s']:.1f} ms; {m['spilled_pages']} pages spilled per prompt")
        if m["gaps"]:
            print_gaps(m["gaps"])
        print("| part | ms |\n|---|---:|")
        for name, ms in sorted(m["parts_ms"].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.1f} |")
        for r in m["top"]:
            print(f"| {r['name'][:90]} | {1e3 * r['s']:.1f} ms | {r['calls']} calls |")
        print_host(m["host_ops"], m["python"], "the mixed steps")
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return result


def drain(engine, n: int, sync, cuda: bool, steps: int = 3) -> dict:
    """A batch that shrinks, as it does when its requests finish: n times, one running request
    ends (aborted) and the next ``steps`` steps are timed, each alone (synchronised: a new batch
    size may run eagerly before its graph is captured); the first step of the last size runs
    under the profiler: its kernels, the host side and the GPU's idle gaps."""
    sizes = []
    region = None
    n = min(n, len(engine.scheduler.running) - 1)  # one request stays
    for i in range(n):
        engine.abort(engine.scheduler.running[-1].request_id)
        walls = []
        for j in range(steps):
            sync()
            t0 = time.perf_counter()
            with (profiled(engine, cuda) if i == n - 1 and j == 0 else contextlib.nullcontext()) as got:
                engine.step()
                sync()
            region = got or region
            walls.append(time.perf_counter() - t0)
        sizes.append({"batch": engine.last_stats.num_running, "step_s": walls})
        print(f"drain: batch {sizes[-1]['batch']}: steps " + ", ".join(f"{1e3 * w:.2f}" for w in walls)
              + " ms" + (" (the first profiled)" if i == n - 1 else ""))
    out = {"sizes": sizes}
    if region is not None:
        out.update(region.summary())
        print_host(out["host_ops"], out["python"], "the first step at the last batch size")
        if out["gaps"]:
            print_gaps(out["gaps"])
        print("| kernel | ms | calls |\n|---|---:|---:|")
        for r in out["top"]:
            print(f"| {r['name'][:90]} | {1e3 * r['s']:.3f} | {r['calls']} |")
    return out


def mixed_prompt(engine, n: int, params, sync, cuda: bool, layers: int) -> dict:
    """One new prompt of n tokens prefilled beside the running batch: the steps until its first
    token and their wall time as served (no profiler), then a second such prompt under the
    profiler: its kernels by part, the host side, and the GPU's idle gaps, each named by the
    host region that ran while the GPU waited."""
    def one_prompt(seed: int) -> tuple[int, float]:
        rid = engine.add_request([seed + (11 * j) % 30000 for j in range(n)], params)
        sync()
        steps, t0 = 0, time.perf_counter()
        while True:
            outs = engine.step()
            steps += 1
            if any(o.request_id == rid for o in outs) or steps > 64:
                break
        sync()
        return steps, time.perf_counter() - t0

    spilled0 = getattr(engine.kv, "num_spilled_segments", 0)
    steps, wall = one_prompt(2000)  # as served
    with profiled(engine, cuda) as region:
        _, profiled_wall = one_prompt(3000)
    parts: dict[str, float] = {}
    for name, t, _ in region.rows:
        parts[kernel_part(name)] = parts.get(kernel_part(name), 0.0) + 1e3 * t
    segs = getattr(engine.kv, "num_spilled_segments", 0) - spilled0
    seg_pages = getattr(getattr(engine.kv, "host", None), "segment_pages", 0)
    return {"prompt_tokens": n, "steps": steps, "wall_s": wall, "profiled_wall_s": profiled_wall,
            "parts_ms": parts, "spilled_pages": segs * seg_pages // 2, **region.summary()}



if __name__ == "__main__":
    main()
