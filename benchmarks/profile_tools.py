"""What a profile of an engine's steps says (``profile_step.py``'s and ``prefill_ttft.py``'s):
kernels by name and by step part (``kernel_rows``, ``kernel_part``), the host side by
operator and by Python function (``host_rows``, ``host_profile``), the GPU's idle gaps named by
the engine's host region open at the time (``labelled``, ``gpu_gaps``), and a block under all
of them (``profiled``).
"""

from __future__ import annotations

import contextlib

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


def print_gaps(g: dict) -> None:
    """``gpu_gaps``' result: the GPU's idle time, by host region, and its longest gaps."""
    print(f"GPU idle {g['idle_ms']:.1f} of {g['span_ms']:.1f} ms (profiled); gaps >= 0.5 ms by host region: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(g["idle_in_gaps_ms_by_region"].items(), key=lambda kv: -kv[1])))
    for r in g["longest"][:12]:
        print(f"  gap {r['ms']:.2f} ms in {r['region']} ({r['host_op']}) after {r['after_kernel'][:40]}")


class profiled:
    """A block under torch.profiler (CPU, and CUDA where ``cuda``), cProfile and the engine's
    labelled host regions (``labelled``); after it, ``rows`` (``kernel_rows``) and
    ``summary()``: its kernels' time, the host side, the GPU's idle gaps and the top kernels."""

    def __init__(self, engine, cuda: bool) -> None:
        self.engine, self.cuda = engine, cuda

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(labelled(self.engine))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = self._stack.enter_context(profile(activities=activities))
        self.py = self._stack.enter_context(host_profile())
        return self

    def __exit__(self, *exc):
        self._stack.__exit__(*exc)
        self.rows = kernel_rows(self.prof, self.cuda)
        return False

    def summary(self) -> dict:
        return {"kernel_s": sum(t for _, t, _ in self.rows), "host_ops": host_rows(self.prof),
                "python": self.py.text, "gaps": gpu_gaps(self.prof) if self.cuda else None,
                "top": [{"name": n[:120], "s": t, "calls": c} for n, t, c in self.rows[:15]]}


_HOST_LABEL = "host:"  # the prefix of the labelled host regions' profiler events

# Host regions a mixed step's GPU idle time is charged to: (object path from the engine, method).
_LABELS = (("scheduler", "schedule"), ("kv", "allocate"), ("kv", "spill"), ("runner", "execute"),
           ("runner.attention", "begin_step"), ("runner.attention", "end_step"), ("sampler", "sample"),
           ("", "_stats"), ("output_processor", "append_token"))


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
