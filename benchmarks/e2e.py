"""End to end: four ways to serve long contexts, on the same workload in the same run.

    python benchmarks/e2e.py --gpu-kv-gib 24 --out results/      # Llama-3.1-8B shapes, CUDA
    python benchmarks/e2e.py --tiny --out /tmp/e2e                # toy shapes, CPU, < 1 minute

The engine runs at Llama-3.1-8B shapes (32 layers, 32 query / 8 KV heads, D=128, bf16) with
random weights (``model.load_format: dummy``): the tokens are meaningless, so what is measured
is the system, the scheduler and the memory hierarchy. With ``--model PATH`` it runs that
model's real weights instead, and ``--prompts ruler`` gives it the RULER-style suite's prompts
(``profiling/ruler.py``, through its chat template), so that Select, the buffer's hit ratio and
Retrieve's traffic are those of real attention; ``--config NAME`` runs the spin mode as a
bundled serving config (its sparse section, page size and host dtype), e.g. the one whose
accuracy ``spin-cluster eval --configs NAME`` measures. Modes:

    dense             full attention, every page in GPU memory (``cache.kv_cache_gib`` =
                      --gpu-kv-gib): the batch is what that capacity holds
    dense-offload     full attention over the host tier, every page retrieved each step
    sparse-no-buffer  Quest Select (or --algorithm labels), every selected page retrieved
                      each step (no reuse)
    spin              the same Select + elastic buffer + bucketed LRU + zero-copy Retrieve +
                      S-HPLB per-head budgets (max-min shifted, same total)

Workloads, per mode on one engine: offline batches (``--offline-lengths`` prompts of
``--offline-batch`` requests, ``--output-tokens`` each, all arriving at once) and online
Poisson arrivals at each of ``--rates`` requests/s. Each (mode, workload) gets an equal share
of ``--deadline-s``; one that runs out is stopped and marked ``truncated`` (its figures
cover the tokens produced). Outputs (in --out): e2e.json, e2e.md (table), e2e.png (plot), e2e-timeline.png (every step
over the run, by kind; all three from e2e_report.py).
The dense batch-1 decode step at the longest prompt is compared with its roofline: weight
and KV bytes over the HBM bandwidth measured here (``e2e_roofline.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import shutil
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout without the package installed: last, after an installed one
    sys.path.append(_ROOT)
import e2e_report  # noqa: E402  (same folder: the tables and the plot)
from e2e_roofline import hbm_bandwidth_bytes_s, roofline, step_roofline  # noqa: E402  (same folder)

from spin_cluster.bench.args import add_algorithm, add_budget_tokens, add_out_folder, add_tokenizer  # noqa: E402
MODES = ("dense", "dense-offload", "sparse-no-buffer", "spin")

# --tiny: Llama-3.1-8B's config (spin_cluster.models.shapes) with these fields replaced.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "rope_scaling": None}


@dataclasses.dataclass
class RequestTimes:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_output: int = 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes and sizes on the CPU (smoke test)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                    help="run only these workloads (offline-128K, offline-32K, online-1rps, ...): "
                         "one device call per group when all of them do not fit in one")
    add_engine_args(ap)
    ap.add_argument("--offline-lengths", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--offline-batch", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="requests/s")
    ap.add_argument("--online-length", type=int, default=32768)
    ap.add_argument("--online-requests", type=int, default=4)
    ap.add_argument("--online-output-tokens", type=int, default=64)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="wall time for all measurements (default 480; 60 with --tiny)")
    add_out_folder(ap)
    args = ap.parse_args(argv)
    if args.tiny:
        args.gpu_kv_gib, args.host_kv_gib = 0.002, 0.05
        args.offline_lengths, args.offline_batch, args.output_tokens = [384, 192], 3, 8
        args.rates, args.online_length, args.online_requests, args.online_output_tokens = [4.0, 8.0, 16.0], 128, 3, 4
        args.budget, args.page_size, args.max_num_seqs, args.max_batched_tokens = 64, 16, 4, 256
        if args.prompts == "ruler":  # the suite's prompts need a few hundred tokens of frame
            args.offline_lengths, args.online_length = [1024, 640], 640
        if args.model:  # a real model's layers and heads: room for the toy batches' pages
            args.gpu_kv_gib, args.host_kv_gib = 0.2, 0.5
    # A deadline bounds the run; one given explicitly holds with --tiny too (a loaded machine).
    args.deadline_s = args.deadline_s or (60.0 if args.tiny else 480.0)
    return args


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine's settings every mode is built from (``mode_config``): shared with
    ``profile_step.py`` so that a profile runs the engine the end-to-end run measures."""
    ap.add_argument("--shape", default="llama-3.1-8b", choices=["llama-3.1-8b", "qwen2.5-32b", "gemma-3-27b"],
                    help="the model's shapes (random weights); --tiny overrides them with toy sizes")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a prepared model folder: its real weights instead of --shape's random ones")
    ap.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                    help="--model's model.hf_overrides, e.g. YaRN's rope_scaling past Qwen2.5's 32K")
    ap.add_argument("--prompts", choices=["random", "ruler"], default="random",
                    help="random token ids, or the RULER-style tasks' prompts (with --model: real attention)")
    ap.add_argument("--config", default=None, metavar="NAME",
                    help="spin mode: a bundled config's sparse section, page size and host dtype (spin, "
                         "spin-fast, or a YAML path) in place of the Quest settings below")
    ap.add_argument("--gpu-kv-gib", type=float, default=24.0, help="GPU KV capacity of every mode (pages / buffer)")
    ap.add_argument("--host-kv-gib", type=float, default=72.0, help="host tier of the offloaded modes")
    add_budget_tokens(ap, help="sparse modes: mean middle tokens per KV head")
    add_algorithm(ap, help="sparse modes' Select (graph-safe algorithms)")
    ap.add_argument("--resident-margin", type=float, default=0.0,
                    help="spin: sparse.options.resident_margin, Select's hysteresis in nats (0: off)")
    ap.add_argument("--coarse-pages", type=int, default=0, metavar="GP",
                    help="sparse modes, quest: two-level Select over groups of GP pages (sparse.options.coarse_pages; "
                         "0: off)")
    ap.add_argument("--coarse-factor", type=int, default=4,
                    help="two-level Select: candidate pages per budgeted page (sparse.options.coarse_factor)")
    ap.add_argument("--coarse-split", action=argparse.BooleanOptionalAction, default=True,
                    help="two-level Select: each scoring stage over many programs a row, two launches "
                         "(sparse.options.coarse_split)")
    ap.add_argument("--sparse-option", action="append", default=[], metavar="KEY=VALUE",
                    help="sparse modes: more sparse.options, e.g. channels=0.5 or index_dtype=float8_e4m3fn "
                         "(repeatable; over the bfloat16 index and the --coarse-* options)")
    ap.add_argument("--per-head-shares", action=argparse.BooleanOptionalAction, default=True,
                    help="spin: BufferPolicy.per_head_shares, each head's buffer share sized by its own S-HPLB budget")
    ap.add_argument("--buffer-share", type=float, default=0.0,
                    help="spin: cache.buffer_share, a share's cap as a multiple of the pages a step selects "
                         "(0: none, shares grow into every free slot of the GPU memory budget)")
    ap.add_argument("--sparse-prefill", type=float, default=0.0, metavar="FRACTION",
                    help="sparse modes: block-sparse prefill (strided estimate, S-HPLB-like per-head fractions "
                         "of this mean; 0: dense prefill, as dense runs)")
    ap.add_argument("--gpu-home-fraction", type=float, default=None,
                    help="spin: cache.gpu_home_fraction, the share of --gpu-kv-gib holding pages at home "
                         "(default: the cache's own split; 0: the host is every page's home)")
    ap.add_argument("--host-kv-dtype", choices=["auto", "fp8"], default="auto",
                    help="spin: cache.host_kv_dtype (fp8: e4m3 host pages with a scale per token row, "
                         "0.52x the host and PCIe bytes of bf16)")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=65536,
                    help="prefill chunk size: a 128K prompt in two chunks (later chunks of an offloaded "
                         "request gather its earlier context from the host tier in every layer)")
    add_tokenizer(ap)
    ap.add_argument("--async-decode", choices=["auto", "on", "off"], default="auto",
                    help="scheduler.async_decode: pipelined decode steps (auto: on with CUDA)")


def _import_package() -> None:
    """The installed package (pip, or /tmp/pkg on the GPU machine), else this checkout's."""
    try:
        import spin_cluster.kernels  # noqa: F401
    except ImportError:
        sys.path.insert(0, _ROOT)


def mode_config(mode: str, args, folder: str, max_len: int, shape: dict) -> dict:
    device = {"device": "cpu", "dtype": "float32"} if args.tiny else {"dtype": "bfloat16"}
    weights = {"load_format": "auto", "hf_overrides": args.hf_overrides} if args.model else {"load_format": "dummy"}
    cfg = {
        "model": {"path": folder, "max_model_len": max_len, **weights, **device},
        "cache": {"page_size": args.page_size, "kv_cache_gib": args.gpu_kv_gib},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched_tokens,
                      "async_decode": {"auto": None, "on": True, "off": False}[getattr(args, "async_decode", "auto")]},
        "sparse": {},
    }
    if mode == "dense":
        return cfg
    # Spin's pages live on the GPU while it has room (cache.gpu_home_fraction); the offload
    # baselines keep every page's home on the host, as their names say (and reuse nothing:
    # ``mode_buffer_policy``).
    cfg["cache"].update(kind="offloaded", host_kv_gib=args.host_kv_gib,
                        gpu_home_fraction=args.gpu_home_fraction if mode == "spin" else 0.0)
    if mode == "dense-offload":
        return cfg
    if args.config and mode == "spin":
        from spin_cluster.profiling import bundled

        sections = bundled.load(args.config)
        cfg["sparse"] = sections["sparse"]
        cfg["cache"].update({k: v for k, v in sections["cache"].items() if k != "kind"},
                            buffer_share=args.buffer_share)
        return cfg
    # A bfloat16 index halves the bytes Select reads (Quest's bounds are rounded outward).
    cfg["sparse"] = {"algorithm": args.algorithm, "budget": args.budget, "local_tokens": 2 * args.page_size,
                     "sink_tokens": args.page_size, "options": {"index_dtype": "bfloat16"}}
    if getattr(args, "coarse_pages", 0):
        cfg["sparse"]["options"].update(coarse_pages=args.coarse_pages, coarse_factor=args.coarse_factor,
                                        coarse_split=args.coarse_split)
    if getattr(args, "sparse_option", None):
        from spin_cluster.config import option_pairs

        cfg["sparse"]["options"].update(option_pairs(args.sparse_option))
    if args.sparse_prefill:
        from spin_cluster.hplb.budget import synthetic_prefill_config

        cfg["sparse"]["prefill"] = synthetic_prefill_config(shape["num_hidden_layers"], shape["num_key_value_heads"],
                                                            args.sparse_prefill)
    if mode == "spin":
        from spin_cluster.hplb.budget import synthetic_maxmin_budgets

        if args.resident_margin:
            cfg["sparse"]["options"]["resident_margin"] = args.resident_margin
        cfg["cache"].update(buffer_share=args.buffer_share, host_kv_dtype=getattr(args, "host_kv_dtype", "auto"))

        cfg["sparse"]["options"]["per_head_budgets"] = synthetic_maxmin_budgets(
            shape["num_hidden_layers"], shape["num_key_value_heads"], args.budget, args.page_size)
    return cfg


def mode_buffer_policy(mode: str, args):
    """The offloaded cache's buffer mechanisms of ``mode`` (``BufferPolicy``): the offload
    baselines retrieve every page a step reads (no reuse between steps); spin sizes its heads'
    shares by their own budgets unless --no-per-head-shares."""
    from spin_cluster.kvcache.buffer_policy import BufferPolicy

    if mode == "spin":
        return BufferPolicy(per_head_shares=args.per_head_shares)
    return BufferPolicy(reuse=mode == "dense")  # dense: the paged cache, no buffer at all


# ---- driving the engine ------------------------------------------------------------------------


def run_workload(engine, prompts: list[list[int]], arrivals_s: list[float], max_tokens: int, deadline: float) -> dict:
    """Add each prompt at its arrival time (seconds from now), step until all finish or the
    deadline passes; per-request times and per-step records."""
    from spin_cluster.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic()
    times: dict[str, RequestTimes] = {}
    steps: list[tuple[float, int, bool, int]] = []  # (seconds, tokens run, decode only, running)
    capture_s: list[float] = []  # steps that captured a CUDA graph
    pending = sorted(zip(arrivals_s, range(len(prompts))))
    truncated = False
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            at, i = pending.pop(0)
            times[engine.add_request(prompts[i], params)] = RequestTimes(arrival_s=start + at)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        if time.monotonic() > deadline:
            truncated = True
            break
        # A decode-only step: every token it ran was a decode token of a running request
        # (requests waiting for room do not make it a prefill step).
        ready = sum(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)
        captures = getattr(engine.runner.graphs, "captures", 0)
        t0 = time.perf_counter()
        outputs = engine.step()
        if not engine.async_decode:  # a pipelined step returns once its tokens are read; the next runs on
            _sync(engine)
        tokens = engine.last_stats.num_batched_tokens
        seconds = time.perf_counter() - t0
        if getattr(engine.runner.graphs, "captures", 0) != captures:
            # A new decode shape ran eagerly and was captured (once per shape in a server's
            # life; dense captures its graphs at start-up): counted apart, not as decode speed.
            capture_s.append(seconds)
            tokens = 0
        steps.append((seconds, tokens, 0 < tokens == ready, engine.last_stats.num_running))
        record_outputs(times, outputs, time.monotonic())
    for rid, rt in times.items():
        if rt.finished_s is None:
            engine.abort(rid)
    return {**summarize(list(times.values()), steps, time.monotonic() - start, truncated, engine),
            "capture_steps": len(capture_s), "capture_s": sum(capture_s),
            # Every step, for a timeline: [ms, tokens run, decode only, running requests].
            "step_log": [[round(1e3 * s, 2), n, int(only), r] for s, n, only, r in steps]}


def record_outputs(times: dict[str, RequestTimes], outputs, t: float) -> int:
    """A step's outputs into their requests' times (request id -> RequestTimes), at ``t``;
    returns how many requests finished."""
    finished = 0
    for out in outputs:
        rt = times[out.request_id]
        rt.num_output += len(out.new_token_ids)
        rt.first_token_s = rt.first_token_s or t
        if out.new_token_ids:
            rt.last_token_s = t
        if out.finished:
            rt.finished_s = t
            finished += 1
    return finished


def summarize(times: list[RequestTimes], steps, wall_s: float, truncated: bool, engine) -> dict:
    ttft = [r.first_token_s - r.arrival_s for r in times if r.first_token_s]
    # Per request, over the tokens it produced: a request cut off by the deadline counts too
    # (its TPOT so far), so that a mode too slow to finish inside its slice still has one.
    tpot = [(r.last_token_s - r.first_token_s) / (r.num_output - 1) for r in times if r.num_output > 1]
    decode = [(s, n) for s, n, only, _ in steps if only]
    prompt_steps = [(s, n) for s, n, only, _ in steps if n and not only]
    stats = engine.last_stats
    return {
        "requests": len(times), "finished": sum(r.finished_s is not None for r in times), "truncated": truncated,
        "wall_s": wall_s, "output_tokens": sum(r.num_output for r in times),
        "throughput_tok_s": sum(r.num_output for r in times) / wall_s if wall_s else 0.0,
        "decode_tok_s": sum(n for _, n in decode) / sum(s for s, _ in decode) if decode else None,
        "batch1_decode_step_s": _median([s for s, n in decode if n == 1]),
        "decode_steps": sum(1 for _, n, _, _ in steps if n),
        # Steps that ran prompt tokens (with the decodes that rode along): their seconds and
        # tokens per second, the prefill side of the whole-batch time.
        "prompt_steps_s": sum(s for s, _ in prompt_steps),
        "prompt_step_tok_s": (sum(n for _, n in prompt_steps) / sum(s for s, _ in prompt_steps)
                              if prompt_steps else None),
        "decode_only_steps_s": sum(s for s, _ in decode),
        "peak_running": max((r for *_, r in steps), default=0),
        "peak_decode_batch": max((n for _, n in decode), default=0),
        # Decode-only steps at the largest batch: median and spread (10th / 90th percentile).
        **{f"full_batch_step_s_p{p}": _pct([s for s, n in decode if n == max(m for _, m in decode)], p)
           for p in (10, 50, 90)},
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "buffer_hits_total": stats.buffer_hits_total, "buffer_misses_total": stats.buffer_misses_total,
        "spilled_pages_total": getattr(stats, "spilled_pages_total", 0),
        "preemptions_total": getattr(stats, "preemptions_total", 0),
        # Home pages per tier (used, total) as the run ended, for the offloaded cache.
        "tier_pages": _tier_pages(engine),
        # Decode steps that replayed a CUDA graph, and graphs captured, since the engine started.
        "graph_replays": getattr(engine.runner.graphs, "replays", None),
        "graph_captures": getattr(engine.runner.graphs, "captures", None),
    }


def _tier_pages(engine) -> dict | None:
    """Home pages per tier, (used, total), of an offloaded cache; None for dense's."""
    tiers = getattr(getattr(engine, "kv", None), "tier_pages", None)
    return tiers() if tiers else None


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _sync(engine) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def workloads(args, vocab: int, folder: str) -> list[tuple[str, list[list[int]], list[float], int]]:
    """(name, prompts, arrival seconds, output tokens), the most telling first."""
    rng = random.Random(0)
    if args.prompts == "ruler":
        from spin_cluster.profiling import ruler
        from spin_cluster.tokenizer import Tokenizer

        tokenizer, tasks, seeds = Tokenizer(folder), ruler.task_names(), iter(range(10**6))

        def prompt(n):  # the suite's tasks in turn, each prompt a new seed
            seed = next(seeds)
            return list(ruler.make_sample(tasks[seed % len(tasks)], tokenizer, n, seed).prompt_ids)
    else:
        def prompt(n):
            return [rng.randrange(1000, min(vocab, 40000)) for _ in range(n)]

    out = [(f"offline-{n // 1024}K" if n >= 1024 else f"offline-{n}", [prompt(n) for _ in range(args.offline_batch)],
            [0.0] * args.offline_batch, args.output_tokens) for n in args.offline_lengths]
    for rate in sorted(args.rates, reverse=True):
        gaps = [rng.expovariate(rate) for _ in range(args.online_requests)]
        arrivals = [sum(gaps[:i]) for i in range(args.online_requests)]
        out.append((f"online-{rate:g}rps", [prompt(args.online_length) for _ in range(args.online_requests)],
                    arrivals, args.online_output_tokens))
    return out


def warm_up(engine, mode: str, lengths: list[int], args, bandwidth: float | None) -> dict | None:
    """Every mode alike before its timed requests: one prompt of each workload's length and a
    few decode steps after it. Kernels compile a variant per size class of their launch (the
    block-sparse prefill is also autotuned per class), and a class first met in a timed step
    cost that step seconds (Spin's first 128K decode row: 3.5 s of compiles in a prompt step,
    benchmarks/trace_compiles.py). Dense's batch-1 request at the longest offline length (32
    decode steps alone, against the roofline) is its warm-up of that length: its roofline is
    returned (None for the other modes and at toy size). Then, as a served engine warms up
    (``Engine.warm_up``), a draining batch where decode graphs are captured lazily (Spin's):
    a decode step at every batch size, whose first run compiles kernels too."""
    from spin_cluster.engine import SamplingParams
    from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs
    from spin_cluster.engine.warm_up import warm_batches, zero_totals

    engine.generate([[1000 + i for i in range(3 * args.page_size)]])  # the toy-size compiles
    if args.tiny:
        return None
    if isinstance(engine.runner.graphs, SpinDecodeGraphs):
        t0 = time.monotonic()
        sizes = warm_batches(engine)
        zero_totals(engine)
        print(f"[{mode}] warmed decode steps at batch sizes {sizes[0] if sizes else 0}..1 in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    measured = max(args.offline_lengths) if mode == "dense" else None
    found = None
    for n in sorted(set(lengths) | ({measured} if measured else set())):
        prompt = [[1000 + i % 30000 for i in range(n)]]
        if n == measured:
            r = run_workload(engine, prompt, [0.0], 32, time.monotonic() + 60)
            found = roofline(engine, n, r["batch1_decode_step_s"], bandwidth)
            print(f"[dense] roofline: {json.dumps(found)}", flush=True)
        else:
            engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return found


# ---- main ---------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv)
    _import_package()
    import torch

    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine

    from spin_cluster.models.shapes import SHAPES, shape_folder, tiny
    from spin_cluster.provenance import write_json

    longest = max(args.offline_lengths + [args.online_length])
    max_len = longest + max(args.output_tokens, args.online_output_tokens) + args.page_size
    if args.model:  # real weights: the folder is the user's, read, never removed
        folder = args.model
        with open(os.path.join(folder, "config.json")) as f:
            shape = {**json.load(f), **(args.hf_overrides or {})}
    else:
        shape = tiny(SHAPES[args.shape], TINY) if args.tiny else SHAPES[args.shape]
        folder = shape_folder(shape, max_len, args.tokenizer, prefix="e2e-model-")
    runs = workloads(args, shape["vocab_size"], folder)
    if args.workloads:
        unknown = set(args.workloads) - {name for name, *_ in runs}
        if unknown:
            raise SystemExit(f"unknown workload(s) {sorted(unknown)}; these exist: {[name for name, *_ in runs]}")
        runs = [r for r in runs if r[0] in args.workloads]
    start = time.monotonic()
    bandwidth = None if args.tiny else hbm_bandwidth_bytes_s()
    results = {"modes": args.modes, "gpu_kv_gib": args.gpu_kv_gib, "host_kv_gib": args.host_kv_gib,
               "budget": args.budget, "shape": shape, "args": vars(args),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
               "workloads": {name: {} for name, *_ in runs}}
    if torch.cuda.is_available() and not args.tiny:  # the SDPA kernel of every mode's dense prefill
        from spin_cluster.dense_attention import device_backend

        results["dense_prefill_backend"] = device_backend(
            torch.device("cuda"), torch.bfloat16, shape["num_attention_heads"], shape["num_key_value_heads"],
            shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]).name
        print(f"dense prefill backend: {results['dense_prefill_backend']}", flush=True)
    # Each (mode, workload) slice gets a share of the time left, weighted by its prefill work
    # (an offline 128K batch needs four times a 32K one; an online rate, 1.5 times a 32K one).
    weights = [len(prompts[0]) / args.online_length if name.startswith("offline") else 1.5
               for name, prompts, *_ in runs]
    weight_left = len(args.modes) * sum(weights)
    os.makedirs(args.out, exist_ok=True)
    for mode in args.modes:
        t0 = time.monotonic()
        try:
            engine = Engine(SpinConfig.from_dict(mode_config(mode, args, folder, max_len, shape)), progress=False,
                            buffer_policy=mode_buffer_policy(mode, args))
        except (RuntimeError, ValueError) as e:  # e.g. the host tier cannot be pinned: the other modes still run
            print(f"[{mode}] could not build the engine: {type(e).__name__}: {e}", flush=True)
            results.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"
            weight_left -= sum(weights)
            continue
        measured = warm_up(engine, mode, sorted({len(p[0]) for _, p, *_ in runs}), args, bandwidth)
        if measured:
            results["roofline"] = measured
        print(f"[{mode}] engine ready in {time.monotonic() - t0:.1f} s", flush=True)
        for (name, prompts, arrivals, max_tokens), weight in zip(runs, weights):
            deadline = time.monotonic() + (start + args.deadline_s - time.monotonic()) * weight / weight_left
            weight_left -= weight
            r = run_workload(engine, prompts, arrivals, max_tokens, deadline)
            r["roofline"] = None if args.tiny else step_roofline(engine, r, len(prompts[0]), bandwidth)
            results["workloads"][name][mode] = r
            print(f"[{mode}] {name}: {json.dumps({k: r[k] for k in ('finished', 'wall_s', 'decode_tok_s', 'ttft_p99_s', 'tpot_p99_s', 'peak_running')})}",
                  flush=True)
        del engine
        gc.collect()
        write_json(os.path.join(args.out, "e2e.json"), results)  # kept if a later mode fails
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not args.model:
        shutil.rmtree(folder, ignore_errors=True)
    write_json(os.path.join(args.out, "e2e.json"), results)
    table = e2e_report.markdown(results)
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write(table)
    e2e_report.plot(results, os.path.join(args.out, "e2e.png"))
    e2e_report.timeline(results, os.path.join(args.out, "e2e-timeline.png"))
    print(table)
    return results


if __name__ == "__main__":
    main()
