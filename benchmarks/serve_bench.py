"""A request stream at a sweep of Poisson rates: throughput, goodput, TTFT/TPOT percentiles, dense beside Spin.

    python -m spin_cluster.bench serve --modes dense spin --request-rate 0.25 0.5 1 inf --num-prompts 128 \\
        --goodput ttft:30000 tpot:100 --gpu-kv-gib 108 --host-kv-gib 88 --max-num-seqs 64 --out results/
    python -m spin_cluster.bench serve --tiny --out /tmp/serve      # toy shapes, CPU, < 1 minute a mode

Modelled on ``vllm bench serve`` (its flag names and metric meanings), but the engine runs in
this process: the GPU machine has no Ray, so there is no HTTP server to send requests to. The
engine, its modes and their flags are e2e.py's (``mode_config``, Llama-3.1-8B shapes with
random weights; ``--tiny`` its toy shapes on the CPU).

For each request rate, ``--num-prompts`` requests of random token ids arrive as a Poisson
process (``inf``: all at time 0), with input and output lengths drawn from
``--input-len-dist`` and ``--output-len-dist``; every mode serves the same requests. With
``--max-concurrency`` an arrived request waits for a free slot, its TTFT counting from its
arrival. Per (mode, rate), as vLLM reports them: completed requests, duration, request,
output and total-token throughput (prefill time included), goodput (requests/s within every
``--goodput`` bound), TTFT and TPOT p50/p99; and the engine's side: the time-weighted mean
and the peak running batch, preemptions, buffer hit ratio and spilled pages over the run.
A run past ``--deadline-s`` is stopped, its requests aborted, and marked truncated. Per mode,
the saturated throughput is the highest output throughput over the rates.
Outputs (in --out): serve.json, serve.md (table, also printed), serve.png (throughput and
TTFT p99 against the rate).

    python -m spin_cluster.bench serve --merge dense/serve.json spin/serve.json --out results/

merges runs made apart (one mode or one rate per GPU call, when a call's time cannot hold
them all) into one report, after checking that they served the same request stream.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import random
import shutil
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402  (same folder: the engine's modes, flags and summary)

from spin_cluster.bench.args import add_out_folder  # noqa: E402

# --tiny: e2e's toy engine sizes, and a stream small enough for the CPU.
TINY = {"gpu_kv_gib": 0.002, "host_kv_gib": 0.05, "budget": 64, "page_size": 16, "max_num_seqs": 4,
        "max_batched_tokens": 256, "input_len_dist": "log-uniform:64:384", "output_len_dist": "uniform:4:16",
        "num_prompts": 6, "request_rate": [8.0, math.inf], "deadline_s": 60.0}
GOODPUT_KEYS = ("ttft", "tpot")


class LengthDist(NamedTuple):
    kind: str  # fixed, uniform or log-uniform
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        if self.kind == "log-uniform":  # as many short prompts per doubling as long ones
            return min(self.hi, max(self.lo, round(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi))))))
        return rng.randint(self.lo, self.hi)  # fixed: lo == hi

    def __str__(self) -> str:
        return f"fixed:{self.lo}" if self.kind == "fixed" else f"{self.kind}:{self.lo}:{self.hi}"


# ---- arguments ----------------------------------------------------------------------------------


def length_dist(spec: str) -> LengthDist:
    """``fixed:N``, ``uniform:LO:HI`` or ``log-uniform:LO:HI`` (tokens, 1 <= LO <= HI)."""
    kind, *fields = spec.split(":")
    arity = {"fixed": 1, "uniform": 2, "log-uniform": 2}
    values = [int(f) for f in fields if f.isdigit()]  # "-3", "x": left out, so the count below differs
    if kind not in arity or not len(fields) == len(values) == arity[kind] or not 1 <= values[0] <= values[-1]:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected fixed:N, uniform:LO:HI or log-uniform:LO:HI "
                                         "(tokens, 1 <= LO <= HI)")
    return LengthDist(kind, values[0], values[-1])


def goodput_slo(item: str) -> tuple[str, float]:
    """vLLM's ``--goodput`` item ``KEY:MS``: a bound in milliseconds on a request's TTFT or TPOT."""
    key, _, ms = item.partition(":")
    try:
        bound = float(ms)
    except ValueError:
        bound = math.nan
    if key not in GOODPUT_KEYS or not bound >= 0:
        raise argparse.ArgumentTypeError(f"{item!r}: expected ttft:MS or tpot:MS (milliseconds, >= 0)")
    return key, bound


def request_rate(text: str) -> float:
    rate = float(text)  # argparse reports the ValueError as an invalid value
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate is > 0 requests/s (inf: all at once)")
    return rate


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes and sizes on the CPU (smoke test)")
    ap.add_argument("--modes", nargs="+", default=["dense", "spin"], choices=e2e.MODES)
    e2e.add_engine_args(ap)  # the flags mode_config reads, with e2e's meanings
    ap.add_argument("--request-rate", type=request_rate, nargs="+", default=[0.25, 0.5, 1.0, math.inf],
                    metavar="RATE", help="the sweep: Poisson arrivals at RATE requests/s (inf: all at time 0)")
    ap.add_argument("--num-prompts", type=int, default=128, help="requests per rate")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="at most this many requests in the engine; arrived ones wait (default: no cap)")
    ap.add_argument("--seed", type=int, default=0, help="arrivals, lengths and token ids")
    ap.add_argument("--input-len-dist", type=length_dist, default="log-uniform:8192:131072", metavar="DIST",
                    help="prompt tokens: fixed:N, uniform:LO:HI or log-uniform:LO:HI")
    ap.add_argument("--output-len-dist", type=length_dist, default="uniform:256:2048", metavar="DIST",
                    help="output tokens (ignore_eos): fixed:N, uniform:LO:HI or log-uniform:LO:HI")
    ap.add_argument("--goodput", type=goodput_slo, nargs="+", default=[], metavar="KEY:MS",
                    help="SLO of goodput, vLLM's syntax: ttft:MS tpot:MS (a request counts within every bound)")
    ap.add_argument("--deadline-s", type=float, default=600.0,
                    help="wall time of each (mode, rate) run (default 600; 60 with --tiny)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: merge these serve.json files (the same stream, made apart) into --out")
    add_out_folder(ap)
    # --tiny changes the defaults only: a flag given explicitly still holds.
    if ap.parse_known_args(argv)[0].tiny:
        ap.set_defaults(**TINY)
    args = ap.parse_args(argv)
    args.goodput = dict(args.goodput)
    return args


# ---- the request stream -------------------------------------------------------------------------


def workload(args, rate: float) -> tuple[list[float], list[int], list[int]]:
    """(arrival seconds, input lengths, output lengths) of ``rate``'s requests, in arrival order:
    seeded by the seed and the rate alone, so every mode and every sweep sees the same ones."""
    rng = random.Random(f"{args.seed}:{rate:g}")
    n = args.num_prompts
    gaps = [0.0] + [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(n - 1)]
    return (list(itertools.accumulate(gaps)), [args.input_len_dist.sample(rng) for _ in range(n)],
            [args.output_len_dist.sample(rng) for _ in range(n)])


def prompts(args, rate: float, lengths: list[int]) -> list[list[int]]:
    """Random token ids; a generator of their own, so that the lengths do not depend on them."""
    rng = random.Random(f"{args.seed}:{rate:g}:tokens")
    return [[1000 + rng.randrange(30000) for _ in range(n)] for n in lengths]


def drive(engine, prompts: list[list[int]], arrivals_s: list[float], output_lens: list[int],
          max_concurrency: int | None, deadline: float) -> tuple[list, list, float, bool]:
    """e2e's ``run_workload`` with a length of its own per request and a concurrency cap:
    (RequestTimes per request, steps as (seconds, tokens run, decode only, running), wall
    seconds, truncated)."""
    from spin_cluster.engine import SamplingParams

    start = time.monotonic()
    times = [e2e.RequestTimes(arrival_s=start + at) for at in arrivals_s]
    by_id: dict[str, e2e.RequestTimes] = {}  # request id -> its times
    steps: list[tuple[float, int, bool, int]] = []
    admitted, in_flight, truncated = 0, 0, False
    while admitted < len(times) or engine.has_unfinished():
        now = time.monotonic()
        if now > deadline:
            truncated = True
            break
        # Requests are added in arrival order; one over the cap waits, its clock running.
        while (admitted < len(times) and times[admitted].arrival_s <= now
               and (max_concurrency is None or in_flight < max_concurrency)):
            params = SamplingParams(temperature=0, max_tokens=output_lens[admitted], ignore_eos=True)
            by_id[engine.add_request(prompts[admitted], params)] = times[admitted]
            admitted, in_flight = admitted + 1, in_flight + 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(times[admitted].arrival_s, deadline) - now))
            continue
        # As in e2e: a decode-only step ran a token of every running request and nothing else.
        ready = sum(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)
        t0 = time.perf_counter()
        outputs = engine.step()
        if not engine.async_decode:  # a pipelined step returns once its tokens are read; the next runs on
            e2e._sync(engine)
        stats = engine.last_stats
        steps.append((time.perf_counter() - t0, stats.num_batched_tokens,
                      0 < stats.num_batched_tokens == ready, stats.num_running))
        in_flight -= e2e.record_outputs(by_id, outputs, time.monotonic())
    for rid, rt in by_id.items():
        if rt.finished_s is None:
            engine.abort(rid)
    return times, steps, time.monotonic() - start, truncated


# ---- metrics ------------------------------------------------------------------------------------


def counters(engine) -> dict[str, int]:
    """The engine's cumulative counters a run reports the change of."""
    s = engine.last_stats
    return {"hits": s.buffer_hits_total, "misses": s.buffer_misses_total, "spilled": s.spilled_pages_total,
            "preemptions": s.preemptions_total}


def meets_slo(r, slo: dict[str, float]) -> bool:
    """vLLM's goodput test: TTFT and TPOT (0 for a single token) within their bounds, in ms."""
    tpot = (r.last_token_s - r.first_token_s) / (r.num_output - 1) if r.num_output > 1 else 0.0
    return (1e3 * (r.first_token_s - r.arrival_s) <= slo.get("ttft", math.inf)
            and 1e3 * tpot <= slo.get("tpot", math.inf))


def metrics(engine, times: list, steps: list, wall_s: float, truncated: bool, input_lens: list[int],
            before: dict[str, int], slo: dict[str, float]) -> dict:
    summary = e2e.summarize(times, steps, wall_s, truncated, engine)
    done = [r for r in times if r.finished_s is not None]
    # Prompt tokens of the requests that were prefilled (every one, unless truncated).
    input_tokens = sum(n for r, n in zip(times, input_lens) if r.first_token_s)
    delta = {k: v - before[k] for k, v in counters(engine).items()}
    lookups = delta["hits"] + delta["misses"]
    busy_s = sum(s for s, *_ in steps)
    return {
        "num_prompts": len(times), "completed": len(done), "truncated": truncated, "duration_s": wall_s,
        "input_tokens": input_tokens, "output_tokens": summary["output_tokens"],
        "request_throughput": len(done) / wall_s,
        "output_throughput": summary["output_tokens"] / wall_s,
        "total_token_throughput": (input_tokens + summary["output_tokens"]) / wall_s,
        "goodput": sum(meets_slo(r, slo) for r in done) / wall_s if slo else None,
        **{k: summary[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "decode_tok_s",
                                   "peak_running", "prompt_steps_s", "prompt_step_tok_s", "decode_only_steps_s")},
        # Weighted by each step's seconds: the batch the engine ran, on average, while it ran.
        "mean_running": sum(s * n for s, _, _, n in steps) / busy_s if busy_s else 0.0,
        "preemptions": delta["preemptions"], "spilled_pages": delta["spilled"],
        "buffer_hit_ratio": delta["hits"] / lookups if lookups else None,
    }


def run_rate(engine, args, rate: float) -> dict:
    arrivals, input_lens, output_lens = workload(args, rate)
    before = counters(engine)
    times, steps, wall_s, truncated = drive(engine, prompts(args, rate, input_lens), arrivals, output_lens,
                                            args.max_concurrency, time.monotonic() + args.deadline_s)
    return metrics(engine, times, steps, wall_s, truncated, input_lens, before, args.goodput)


# ---- report -------------------------------------------------------------------------------------


def prompts_per_rate(results: dict) -> str:
    """"128 prompts per rate", or each rate's count where a merge joined rates of different counts."""
    counts = {rate: r["num_prompts"] for by_rate in results["runs"].values() for rate, r in by_rate.items()}
    if len(set(counts.values())) <= 1:
        return f"{next(iter(counts.values()), results['args']['num_prompts'])} prompts per rate"
    return "prompts per rate " + ", ".join(f"{rate}: {counts[rate]}" for rate in results["request_rates"])


def markdown(results: dict) -> str:
    def f(x, scale=1.0, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x * scale)

    a = results["args"]
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in a["goodput"].items()) or "none"
    lines = [f"{results['device']}; {prompts_per_rate(results)}, input {a['input_len_dist']} tokens, "
             f"output {a['output_len_dist']} tokens; max concurrency {a['max_concurrency'] or 'none'}; GPU KV "
             f"{a['gpu_kv_gib']} GiB, host tier {a['host_kv_gib']} GiB, sparse budget {a['budget']} tokens/head; "
             f"goodput SLO: {slo}", "",
             "| mode | rate req/s | completed | duration s | req/s | output tok/s | total tok/s | goodput req/s "
             "| TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms | mean batch | peak batch | preemptions "
             "| hit ratio | spilled pages |", "|---|---:|" + "---:|" * 15]
    for mode, runs in results["runs"].items():
        for rate, r in runs.items():
            mark = " (truncated)" if r["truncated"] else ""
            lines.append(
                f"| {mode} | {rate} | {r['completed']}/{r['num_prompts']}{mark} | {r['duration_s']:.1f} "
                f"| {r['request_throughput']:.3f} | {r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} "
                f"| {f(r['goodput'], fmt='{:.3f}')} | {f(r['ttft_p50_s'])} | {f(r['ttft_p99_s'])} "
                f"| {f(r['tpot_p50_s'], 1e3, '{:.1f}')} | {f(r['tpot_p99_s'], 1e3, '{:.1f}')} "
                f"| {r['mean_running']:.1f} | {r['peak_running']} | {r['preemptions']} "
                f"| {f(r['buffer_hit_ratio'], 100, '{:.1f}%')} | {r['spilled_pages']} |")
    # Steps that ran prompt tokens (with the decodes riding along) against decode-only steps;
    # the rest of the wall time is waiting for arrivals.
    lines += ["", "Where each run's time went:", "",
              "| mode | rate req/s | steps with prompt tokens s | their tok/s | decode-only steps s "
              "| decode tok/s in them |", "|---|---:|---:|---:|---:|---:|"]
    for mode, runs in results["runs"].items():
        for rate, r in runs.items():
            lines.append(f"| {mode} | {rate} | {f(r.get('prompt_steps_s'), fmt='{:.1f}')} "
                         f"| {f(r.get('prompt_step_tok_s'), fmt='{:.0f}')} | {f(r.get('decode_only_steps_s'), fmt='{:.1f}')} "
                         f"| {f(r['decode_tok_s'], fmt='{:.1f}')} |")
    saturated = ", ".join(f"{m} {t:.1f}" for m, t in results["saturated_output_throughput"].items())
    return "\n".join(lines + ["", f"Saturated output throughput (tok/s, the best over the rates): {saturated}", ""])


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = results["request_rates"]
    finite = [float(x) for x in labels if x != "inf"]
    # inf has no place on a rate axis: it goes one doubling right of the highest finite rate.
    xs = {x: 2 * max(finite, default=0.5) if x == "inf" else float(x) for x in labels}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, runs in results["runs"].items():
        order = sorted(runs, key=xs.__getitem__)
        for ax, key in zip(axes, ("output_throughput", "ttft_p99_s")):
            ys = [math.nan if runs[x][key] is None else runs[x][key] for x in order]
            ax.plot([xs[x] for x in order], ys, marker="o", label=mode)
    for ax, ylabel in zip(axes, ("output tokens/s", "TTFT p99 (s)")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(list(xs.values()), labels)
        ax.set_xlabel("request rate (1/s)")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(f"{prompts_per_rate(results)}, input {results['args']['input_len_dist']}, "
                 f"output {results['args']['output_len_dist']} tokens; {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------


def warm_lengths(dist: LengthDist) -> list[int]:
    """Prompt lengths that meet every size class a stream of ``dist`` will: its shortest and
    longest prompt and each power of two between. The decode path's kernels compile a variant
    per power-of-two class of the context's pages (and the block-sparse prefill autotunes per
    class); a class first met by a served request costs that step about a second a kernel."""
    from spin_cluster.engine.warm_up import length_classes

    return length_classes(dist.lo, dist.hi)


def build_engine(mode: str, args, folder: str, max_len: int, shape: dict):
    """e2e's engine of ``mode``, every mode warmed alike before its timed requests: one prompt
    of each of ``warm_lengths`` with a few decode steps after it, so no timed request pays a
    compile (Triton's variants, the block-sparse prefill's autotuning, cuBLAS' choices)."""
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine

    engine = Engine(SpinConfig.from_dict(e2e.mode_config(mode, args, folder, max_len, shape)), progress=False,
                    buffer_policy=e2e.mode_buffer_policy(mode, args))
    engine.warm_up([3 * args.page_size, *warm_lengths(args.input_len_dist)])
    return engine


# What makes two runs' requests the same: runs that differ here cannot share a table. A rate's
# requests are seeded by the seed and the rate alone, so the count may differ between rates (a
# slow rate needs fewer requests to fill a device call), never between two runs of one rate.
STREAM_KEYS = ("seed", "input_len_dist", "output_len_dist", "max_concurrency", "goodput", "shape", "tiny")


def merge(paths: list[str]) -> dict:
    """One report of serve.json files made apart: every (mode, rate) run of each, the later
    file's where two hold the same; an engine error kept only for a mode with no run."""
    import json
    from pathlib import Path

    loaded = [json.loads(Path(p).read_text()) for p in paths]
    base = loaded[0]
    for path, other in zip(paths[1:], loaded[1:]):
        differ = [k for k in STREAM_KEYS if other["args"].get(k) != base["args"].get(k)]
        if differ or other["shape"] != base["shape"]:
            raise SystemExit(f"{path}: not the stream of {paths[0]} ({', '.join(differ) or 'shape'} differ)")
    runs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    ready: dict[str, float] = {}
    for results in loaded:
        for mode, by_rate in results["runs"].items():
            runs.setdefault(mode, {}).update(by_rate)
        errors.update(results.get("errors", {}))
        ready.update(results.get("ready_s", {}))
    rates = sorted({r for by_rate in runs.values() for r in by_rate}, key=float)
    for rate in rates:
        counts = {m: by_rate[rate]["num_prompts"] for m, by_rate in runs.items() if rate in by_rate}
        if len(set(counts.values())) > 1:
            raise SystemExit(f"rate {rate}: not the same requests in every mode (prompts {counts})")
    merged = {**base, "modes": list(runs), "request_rates": rates,
              "merged_from": [{"file": p, "provenance": r.get("provenance")} for p, r in zip(paths, loaded)],
              "ready_s": {m: t for m, t in ready.items() if m in runs},
              "runs": {m: {r: by_rate[r] for r in rates if r in by_rate} for m, by_rate in runs.items()},
              "saturated_output_throughput": {m: max(r["output_throughput"] for r in by_rate.values())
                                              for m, by_rate in runs.items()}}
    merged.pop("errors", None)
    merged.pop("provenance", None)  # the merge's own is written; each run's is under merged_from
    if errors := {m: e for m, e in errors.items() if m not in runs}:
        merged["errors"] = errors
    return merged


def write_report(results: dict, folder: str) -> None:
    """serve.json, serve.md and serve.png in ``folder``; the table also printed."""
    from spin_cluster.provenance import write_json

    write_json(os.path.join(folder, "serve.json"), results)
    table = markdown(results)
    with open(os.path.join(folder, "serve.md"), "w") as f:
        f.write(table)
    plot(results, os.path.join(folder, "serve.png"))
    print(table)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        os.makedirs(args.out, exist_ok=True)
        results = merge(args.merge)
        write_report(results, args.out)
        return results
    e2e._import_package()
    import torch

    from spin_cluster.models.shapes import SHAPES, shape_folder
    from spin_cluster.provenance import write_json

    shape = {**SHAPES[args.shape], **e2e.TINY} if args.tiny else SHAPES[args.shape]
    max_len = args.input_len_dist.hi + args.output_len_dist.hi + args.page_size
    folder = shape_folder(shape, max_len, args.tokenizer, prefix="serve-model-")
    labels = [f"{rate:g}" for rate in args.request_rate]
    # JSON has no inf, and the distributions read best as their flags.
    results = {"modes": args.modes, "request_rates": labels, "shape": shape,
               "args": {**vars(args), "request_rate": labels, "input_len_dist": str(args.input_len_dist),
                        "output_len_dist": str(args.output_len_dist)},
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
               "runs": {}, "saturated_output_throughput": {}}
    out = os.path.join(args.out, "serve.json")
    os.makedirs(args.out, exist_ok=True)
    for mode in args.modes:
        t0 = time.monotonic()
        try:
            engine = build_engine(mode, args, folder, max_len, shape)
        except (RuntimeError, ValueError) as e:  # e.g. the host tier cannot be pinned: the other modes still run
            print(f"[{mode}] could not build the engine: {type(e).__name__}: {e}", flush=True)
            results.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"
            continue
        results.setdefault("ready_s", {})[mode] = round(time.monotonic() - t0, 1)
        print(f"[{mode}] engine ready and warm in {time.monotonic() - t0:.1f} s", flush=True)
        runs = results["runs"][mode] = {}
        for rate, label in zip(args.request_rate, labels):
            r = runs[label] = run_rate(engine, args, rate)
            print(f"[{mode}] rate {label}: {r['completed']}/{r['num_prompts']} in {r['duration_s']:.1f} s, "
                  f"{r['output_throughput']:.1f} output tok/s, TTFT p99 {r['ttft_p99_s']}"
                  + (" (truncated)" if r["truncated"] else ""), flush=True)
        results["saturated_output_throughput"][mode] = max(r["output_throughput"] for r in runs.values())
        del engine
        gc.collect()
        write_json(out, results)  # kept if a later mode fails
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    shutil.rmtree(folder, ignore_errors=True)
    write_report(results, args.out)
    return results


if __name__ == "__main__":
    main()
