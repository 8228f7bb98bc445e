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
Spin graph serves one exact batch size, so a new size runs eagerly first), the last size's
first step profiled. The served steps also give the host's time on the critical path: the
GPU's idle time between one step's sampling and the next step's launch (CUDA events).
Output: a table on stdout and ``profile-<mode>-<context>.json`` in --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder: the modes and the model folder)

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
    engine = Engine(SpinConfig.from_dict(e2e.mode_config(args.mode, args, folder, max_len, shape)), progress=False)
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


def kernel_rows(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, seconds, calls) of a profile, most time first: the GPU's kernels on CUDA, the
    top-level operators on the CPU."""
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        dev_us = getattr(ev, "device_time", None) if cuda else None
        if ev.name.startswith(_HOST_LABEL):  # a labelled host region (``labelled``), mirrored on the GPU's timeline
            continue
        if cuda and ev.device_type.name == "CUDA" and dev_us:
            kernels.setdefault(ev.name, []).append(dev_us / 1e6)
        elif not cuda and _top_level(ev):
            kernels.setdefault(ev.name, []).append(ev.cpu_time_total / 1e6)
    return sorted(((name, sum(ts), len(ts)) for name, ts in kernels.items()), key=lambda r: -r[1])


class host_profile:
    """cProfile around a block: where the host's time goes, by Python function (the
    cumulative top 30 as text in ``.text``)."""

    def __enter__(self):
        import cProfile

        self.prof = cProfile.Profile()
        self.prof.enable()
        return self

    def __exit__(self, *exc):
        import io
        import pstats

        self.prof.disable()
        buf = io.StringIO()
        pstats.Stats(self.prof, stream=buf).sort_stats("cumulative").print_stats(30)
        self.text = buf.getvalue()
        return False


def host_rows(prof, top: int = 25) -> list[dict]:
    """The host side of a torch.profiler run: operators and CUDA runtime calls by their own
    CPU time (a synchronising copy or an event wait shows here, not among the kernels)."""
    rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    return [{"name": a.key[:120], "self_cpu_s": a.self_cpu_time_total / 1e6, "calls": a.count} for a in rows]


def print_host(rows: list[dict], python: str, what: str) -> None:
    print(f"host side of {what}: operators and runtime calls by own CPU time (torch.profiler)")
    print("| op | own CPU ms | calls |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['name'][:90]} | {1e3 * r['self_cpu_s']:.2f} | {r['calls']} |")
    print(f"host side of {what}: Python functions by cumulative time (cProfile)")
    print("\n".join(line for line in python.splitlines()[:45] if line.strip()))


def _top_level(ev) -> bool:
    """A CPU operator under no other operator (labelled host regions do not count)."""
    parent = ev.cpu_parent
    while parent is not None and parent.name.startswith(_HOST_LABEL):
        parent = parent.cpu_parent
    return parent is None


def drain(engine, n: int, sync, cuda: bool, steps: int = 3) -> dict:
    """A batch that shrinks, as it does when its requests finish: n times, one running request
    ends (aborted) and the next ``steps`` steps are timed, each alone (synchronised: a new batch
    size may run eagerly before its graph is captured); the first step of the last size runs
    under the profiler: its kernels, the host side and the GPU's idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    sizes = []
    prof = py = None
    n = min(n, len(engine.scheduler.running) - 1)  # one request stays
    for i in range(n):
        engine.abort(engine.scheduler.running[-1].request_id)
        walls = []
        for j in range(steps):
            sync()
            t0 = time.perf_counter()
            if i == n - 1 and j == 0:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with labelled(engine), profile(activities=activities) as prof, host_profile() as py:
                    engine.step()
                    sync()
            else:
                engine.step()
                sync()
            walls.append(time.perf_counter() - t0)
        sizes.append({"batch": engine.last_stats.num_running, "step_s": walls})
        print(f"drain: batch {sizes[-1]['batch']}: steps " + ", ".join(f"{1e3 * w:.2f}" for w in walls)
              + " ms" + (" (the first profiled)" if i == n - 1 else ""))
    out = {"sizes": sizes}
    if prof is not None:
        rows = kernel_rows(prof, cuda)
        out.update(kernel_s=sum(t for _, t, _ in rows), host_ops=host_rows(prof), python=py.text,
                   gaps=gpu_gaps(prof) if cuda else None,
                   top=[{"name": n_[:120], "s": t, "calls": c} for n_, t, c in rows[:15]])
        print_host(out["host_ops"], out["python"], "the first step at the last batch size")
        if out["gaps"]:
            print_gaps(out["gaps"])
        print("| kernel | ms | calls |\n|---|---:|---:|")
        for r in out["top"]:
            print(f"| {r['name'][:90]} | {1e3 * r['s']:.3f} | {r['calls']} |")
    return out


def print_gaps(g: dict) -> None:
    """``gpu_gaps``' result: the GPU's idle time, by host region, and its longest gaps."""
    print(f"GPU idle {g['idle_ms']:.1f} of {g['span_ms']:.1f} ms (profiled); gaps >= 0.5 ms by host region: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(g["idle_in_gaps_ms_by_region"].items(), key=lambda kv: -kv[1])))
    for r in g["longest"][:12]:
        print(f"  gap {r['ms']:.2f} ms in {r['region']} ({r['host_op']}) after {r['after_kernel'][:40]}")


def mixed_prompt(engine, n: int, params, sync, cuda: bool, layers: int) -> dict:
    """One new prompt of n tokens prefilled beside the running batch: the steps until its first
    token and their wall time as served (no profiler), then a second such prompt under the
    profiler: its kernels by part, the host side, and the GPU's idle gaps, each named by the
    host region that ran while the GPU waited."""
    import torch
    from torch.profiler import ProfilerActivity, profile

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
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled(engine), profile(activities=activities) as prof, host_profile() as py:
        _, profiled_wall = one_prompt(3000)
    rows = kernel_rows(prof, cuda)
    parts: dict[str, float] = {}
    for name, t, _ in rows:
        parts[kernel_part(name)] = parts.get(kernel_part(name), 0.0) + 1e3 * t
    segs = getattr(engine.kv, "num_spilled_segments", 0) - spilled0
    seg_pages = getattr(getattr(engine.kv, "host", None), "segment_pages", 0)
    return {"prompt_tokens": n, "steps": steps, "wall_s": wall, "profiled_wall_s": profiled_wall,
            "kernel_s": sum(t for _, t, _ in rows), "parts_ms": parts, "spilled_pages": segs * seg_pages // 2,
            "host_ops": host_rows(prof), "python": py.text, "gaps": gpu_gaps(prof) if cuda else None,
            "top": [{"name": n_[:120], "s": t, "calls": c} for n_, t, c in rows[:15]]}


_HOST_LABEL = "host:"  # the prefix of the labelled host regions' profiler events

# Host regions a mixed step's GPU idle time is charged to: (object path from the engine, method).
_LABELS = (("scheduler", "schedule"), ("kv", "allocate"), ("kv", "spill"), ("runner", "execute"),
           ("runner.attention", "begin_step"), ("runner.attention", "end_step"), ("sampler", "sample"),
           ("", "_stats"), ("", "_append_token"))


class labelled:
    """Wraps the engine's main host regions (``_LABELS``) in ``torch.profiler.record_function``
    while it is entered, so that a profile names where the host was when the GPU waited."""

    def __init__(self, engine) -> None:
        self.patched = []
        for path, name in _LABELS:
            obj = engine
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part, None)
            if obj is not None and hasattr(obj, name):
                self.patched.append((obj, name, getattr(obj, name), name in vars(obj)))

    def __enter__(self):
        import torch

        for obj, name, fn, _ in self.patched:
            def wrapped(*a, _fn=fn, _label=f"{_HOST_LABEL}{type(obj).__name__}.{name}", **kw):
                with torch.profiler.record_function(_label):
                    return _fn(*a, **kw)
            setattr(obj, name, wrapped)
        return self

    def __exit__(self, *exc):
        for obj, name, fn, own in self.patched:
            if own:  # an instance attribute before: put it back
                setattr(obj, name, fn)
            else:  # the class's method again
                delattr(obj, name)
        return False


def gpu_gaps(prof, min_ms: float = 0.5, top: int = 30) -> dict:
    """The GPU's idle time between its first and last kernel: the total, and the longest gaps
    with the kernels around them and the innermost labelled host region (``labelled``) open at
    the gap's start, else the longest host operator overlapping it."""
    kernels, regions, ops = [], [], []
    for ev in prof.events():
        tr = ev.time_range
        if ev.name.startswith(_HOST_LABEL):  # on the CPU, and mirrored on the GPU's timeline: not a kernel
            if ev.device_type.name == "CPU":
                regions.append((tr.start, tr.end, ev.name[len(_HOST_LABEL):]))
        elif ev.device_type.name == "CUDA" and getattr(ev, "device_time", 0):
            kernels.append((tr.start, tr.end, ev.name))
        elif ev.device_type.name == "CPU":
            ops.append((tr.start, tr.end, ev.name))
    kernels.sort()
    gaps, idle, end = [], 0.0, None
    for i, (b, e, name) in enumerate(kernels):
        if end is not None and b > end:
            idle += b - end
            if b - end >= 1e3 * min_ms:
                gaps.append((b - end, end, b, kernels[i - 1][2], name))
        end = e if end is None else max(end, e)
    def region_at(t: float) -> str | None:  # the innermost labelled region open at t
        open_ = [r for r in regions if r[0] <= t < r[1]]
        return min(open_, key=lambda r: r[1] - r[0])[2] if open_ else None

    out = []
    for length, b, e, before, after in sorted(gaps, reverse=True)[:top]:
        region = region_at(b)
        over = [(min(e, o[1]) - max(b, o[0]), o[2]) for o in ops if o[0] < e and o[1] > b]
        op = max(over)[1] if over else None
        out.append({"ms": length / 1e3, "region": region, "host_op": op, "after_kernel": before[:80],
                    "before_kernel": after[:80]})
    by_region: dict[str, float] = {}
    for length, b, *_ in gaps:
        key = region_at(b) or "(none)"
        by_region[key] = by_region.get(key, 0.0) + length / 1e3
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    return {"span_ms": span, "idle_ms": idle / 1e3, "idle_in_gaps_ms_by_region": by_region, "longest": out}


# Kernel name fragments -> the part of the step they belong to (first match wins); the
# prefill kernels too (benchmarks/prefill_ttft.py's profile).
_PARTS = (
    ("select", ("_page_scores", "_label_scores", "_select_ragged", "_topk_ragged", "_quest_append", "scatter_reduce",
                "index_fill", "_strided_mass", "_quest_select_local", "_select_local", "_select_merge",
                "_bounds_append", "_coarse_select", "_coarse_refresh", "_coarse_groups", "_coarse_pages")),
    ("retrieve", ("_buffer_lookup", "_retrieve_pages")),
    ("offload", ("_write_tokens",)),
    ("attention", ("_paged_decode", "_block_sparse_prefill", "flash", "fmha", "attention", "cudnn", "sdpa")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitK", "cublas")),
    ("layer ops", ("_add_rms_norm", "_rope_qk", "_silu_mul", "rms_norm")),
)


def kernel_part(name: str) -> str:
    """The step part (Select, Retrieve, Offload, attention, GEMMs, layer ops, other) of a kernel."""
    low = name.lower()
    for part, keys in _PARTS:
        if any(k.lower() in low for k in keys):
            return part
    return "other"


if __name__ == "__main__":
    main()
