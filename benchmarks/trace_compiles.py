"""Which Triton kernels compile inside served steps (not a test).

    spin-cluster bench trace-compiles e2e --modes spin ...   # any other `spin-cluster bench` command
    python3 -P benchmarks/trace_compiles.py e2e --modes spin ...   # the same, on the GPU machine

Runs the bench command with a Triton JIT hook and a wrapper around ``Engine.step``, and prints
to stderr, as they happen, every kernel compile (its name and specialisation key) and every step
that took longer than ``SPIN_SLOW_STEP_S`` (default 1 s) with the compiles it waited on. A
compile is seconds of host time inside the step that triggers it; a kernel whose integer
arguments change from step to step (a row index, a length, a position) may compile a new
variant when a value is 1 or a multiple of 16 for the first time.
"""

from __future__ import annotations

import os
import sys
import time


def _diff(old: str, new: str) -> str:
    """What changed in a specialisation (an argument's, or the options' "a=1, b=2" string)."""
    if "=" not in new:
        return f"{old} -> {new}"
    a, b = set(old.split(", ")), set(new.split(", "))
    return f"{sorted(a - b)} -> {sorted(b - a)}"


def _install() -> None:
    from triton import knobs

    from spin_cluster.engine import Engine

    t0 = time.perf_counter()
    pending: list[str] = []
    seen: dict[str, dict[str, str]] = {}  # kernel -> its last compile's specialisation per argument
    slow_s = float(os.environ.get("SPIN_SLOW_STEP_S", "1.0"))

    def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if not already_compiled:
            name = repr.split("[", 1)[0]
            pending.append(name)
            spec = {p.name: str(ty) for p, ty in zip(fn.jit_function.params, key[0])}
            spec["options"] = key[1]
            last = seen.get(name)
            if last is None:
                what = "first"
            elif last == spec:  # Triton's hook fires again for a key it had (its caches are per device)
                what = "the same key again"
            else:
                what = {a: _diff(last.get(a, ""), t) for a, t in spec.items() if last.get(a) != t}
            seen[name] = spec
            print(f"[trace] {time.perf_counter() - t0:9.2f} s compile {name}: {what}", file=sys.stderr, flush=True)
        return False

    knobs.runtime.jit_cache_hook = on_compile
    inner = Engine.step
    count = [0]

    def step(self):
        count[0] += 1
        pending.clear()
        start = time.perf_counter()
        out = inner(self)
        took = time.perf_counter() - start
        if took > slow_s or pending:
            print(f"[trace] {time.perf_counter() - t0:9.2f} s step {count[0]}: {took:.2f} s, "
                  f"{len(pending)} compiles {sorted(set(pending))}", file=sys.stderr, flush=True)
        return out

    Engine.step = step


if __name__ == "__main__":
    _install()
    from spin_cluster.bench.harness import main

    sys.argv = ["spin-cluster bench", *sys.argv[1:]]
    sys.exit(main())
