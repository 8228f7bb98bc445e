"""The elastic buffer policy's effect: concurrency vs buffer hit ratio.

    python benchmarks/buffer_policy.py [--model DIR] [--device cpu] [--out results.json]

SmolLM2 on the offloaded cache with Quest selection, 8 requests of real text (Python's own
documentation strings, about 1K tokens each) arriving together, 48 new tokens each. For a few
GPU buffer sizes, elastic shares (sized from free slots and the queue) vs fixed shares
(every request takes the full share of ``BufferPolicy.pages_per_head`` or waits): peak running requests,
buffer hit ratio, and wall time.
"""

from __future__ import annotations

import argparse
import json
import pydoc
import time

from spin_cluster.bench.args import add_device, add_model, add_out, model_path, save

PAGE, SINK, LOCAL, BUDGET, MAX_SHARE = 16, 16, 64, 128, 64
MANDATORY = SINK // PAGE + BUDGET // PAGE + LOCAL // PAGE  # pages a head selects per step


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    import builtins
    import collections
    import functools
    import itertools
    import json as json_mod
    import os
    import pathlib
    import re

    out = []
    for mod in (builtins, collections, functools, itertools, json_mod, os, pathlib, re)[:n]:
        text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
        ids = tokenizer.encode(text)[:tokens]
        out.append(ids + tokenizer.encode("\n\nSummary of the module above:"))
    return out


def run(model: str, device: str, columns_per_head: int, elastic: bool) -> dict:
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine, SamplingParams
    from spin_cluster.kvcache.buffer_policy import BufferPolicy

    # Slots for `columns_per_head` columns of every (layer, KV head): SmolLM2 30 x 3, fp32.
    slot_bytes = 2 * PAGE * 64 * 4
    gib = columns_per_head * 30 * 3 * slot_bytes / 2**30
    cfg = SpinConfig.from_dict({
        "model": {"path": model, "device": device, "dtype": "float32", "max_model_len": 2048},
        "cache": {"kind": "offloaded", "page_size": PAGE, "kv_cache_gib": gib},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "sparse": {"algorithm": "quest", "budget": BUDGET, "sink_tokens": SINK, "local_tokens": LOCAL},
    })
    eng = Engine(cfg, progress=False, buffer_policy=BufferPolicy(pages_per_head=MAX_SHARE, elastic_shares=elastic))
    for p in prompts(eng.tokenizer, 8, 1000):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    peak, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, eng.last_stats.num_running)
    wall = time.perf_counter() - t0
    st = eng.last_stats
    eng.check_integrity()
    return {"columns_per_head": columns_per_head, "elastic": elastic, "peak_running": peak,
            "hit_ratio": st.buffer_hits_total / max(1, st.buffer_lookups_total),
            "retrieved_mib": st.retrieved_bytes_total / 2**20, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model(ap)
    add_device(ap, default="cpu")
    add_out(ap)
    a = ap.parse_args()
    model = model_path(a)
    rows = []
    for cols in (8 * MANDATORY, 8 * 2 * MANDATORY, 8 * MAX_SHARE):
        for elastic in (True, False):
            if cols < MAX_SHARE and not elastic:
                continue  # a fixed share of MAX_SHARE does not fit at all
            rows.append(run(model, a.device, cols, elastic))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| buffer columns per head | shares | peak running | hit ratio | retrieved MiB | wall s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['columns_per_head']} | {'elastic' if r['elastic'] else 'fixed'} | {r['peak_running']} | "
              f"{r['hit_ratio']:.1%} | {r['retrieved_mib']:.1f} | {r['wall_s']:.1f} |")
    save(a, rows, indent=2)


if __name__ == "__main__":
    main()
