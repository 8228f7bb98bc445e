"""The report of ``benchmarks/e2e.py``: its results as markdown tables (every workload and mode,
each mode's step against its roofline, dense's batch-1 roofline) and as a plot (decode
throughput of the offline batches; TTFT and TPOT against the rate of the online ones)."""

from __future__ import annotations


def markdown(results: dict) -> str:
    def f(x, scale=1.0, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x * scale)

    lines = [f"GPU KV cap: {results['gpu_kv_gib']} GiB; host tier {results['host_kv_gib']} GiB; "
             f"sparse budget {results['budget']} tokens/head; {results['device']}; dense prefill on "
             f"{results.get('dense_prefill_backend', 'the default SDPA dispatch')}"
             + (f"; sparse modes prefill block-sparse ({results['args']['sparse_prefill']:.3g} of the blocks)"
                if results["args"].get("sparse_prefill") else ""), "",
             "| workload | mode | finished | throughput tok/s | decode tok/s | peak batch | TTFT p50 s | TTFT p99 s "
             "| TPOT p50 ms | TPOT p99 ms | hit ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_mode in results["workloads"].items():
        for mode, r in by_mode.items():
            lookups = r["buffer_hits_total"] + r["buffer_misses_total"]
            hit = r["buffer_hits_total"] / lookups if lookups else None
            mark = " (truncated)" if r["truncated"] else ""
            lines.append(
                f"| {name} | {mode} | {r['finished']}/{r['requests']}{mark} | {f(r['throughput_tok_s'], fmt='{:.1f}')} "
                f"| {f(r['decode_tok_s'], fmt='{:.1f}')} | {r['peak_running']} | {f(r['ttft_p50_s'])} "
                f"| {f(r['ttft_p99_s'])} | {f(r['tpot_p50_s'], 1e3, '{:.1f}')} | {f(r['tpot_p99_s'], 1e3, '{:.1f}')} "
                f"| {f(hit, 100, '{:.1f}%')} |")
    steps = [(name, mode, r["roofline"], by_mode.get("dense")) for name, by_mode in results["workloads"].items()
             for mode, r in by_mode.items() if r.get("roofline")]
    if steps:
        lines += ["", "| workload | mode | decode batch | step ms | roofline ms (HBM GB + PCIe GB) | x roofline "
                  "| decode tok/s vs dense |", "|---|---|---:|---:|---:|---:|---:|"]
        for name, mode, rl, dense in steps:
            r = results["workloads"][name][mode]
            vs = r["decode_tok_s"] / dense["decode_tok_s"] if dense and dense.get("decode_tok_s") else None
            lines.append(f"| {name} | {mode} | {rl['batch']} | {1e3 * rl['measured_step_s']:.2f} "
                         f"| {1e3 * rl['bound_step_s']:.2f} ({rl['hbm_bytes'] / 1e9:.1f} + {rl['pcie_bytes'] / 1e9:.2f}) "
                         f"| {rl['x_roofline']:.2f} | {f(vs, fmt='{:.2f}x')} |")
    split = [(name, mode, time_split(r["step_log"])) for name, by_mode in results["workloads"].items()
             for mode, r in by_mode.items() if r.get("step_log")]
    if split:
        lines += ["", "Where the time went (seconds in steps, and the steps' count):", "",
                  "| workload | mode | prompt steps | decode-only steps | graph captures | idle |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, mode, t in split:
            lines.append(f"| {name} | {mode} | " + " | ".join(f"{t[k][0]:.1f} ({t[k][1]})" for k in STEP_KINDS) + " |")
    rf = results.get("roofline")
    if rf and rf.get("fraction_of_roofline"):
        lines += ["", f"Dense batch-1 decode at {rf['context']} tokens: {1e3 * rf['measured_step_s']:.2f} ms/step, "
                  f"roofline {1e3 * rf['bound_step_s']:.2f} ms ({(rf['weight_bytes'] + rf['kv_bytes']) / 1e9:.1f} GB "
                  f"at {rf['hbm_bytes_s'] / 1e12:.2f} TB/s): {100 * rf['fraction_of_roofline']:.0f}% of roofline"]
    return "\n".join(lines) + "\n"


# A step of ``e2e.run_workload``'s log ([ms, tokens, decode only, running]) is one of these:
# a step that ran prompt tokens (with the decodes riding along), a decode-only step, a step
# whose new decode shape was captured as a CUDA graph (logged with 0 tokens), or an idle one.
STEP_KINDS = ("prompt", "decode", "capture", "idle")


def step_kind(step: list) -> str:
    _, tokens, decode_only, running = step
    if tokens:
        return "decode" if decode_only else "prompt"
    return "capture" if running else "idle"


def time_split(step_log: list[list]) -> dict[str, tuple[float, int]]:
    """Seconds and count of the steps of each kind (``STEP_KINDS``)."""
    out = {k: (0.0, 0) for k in STEP_KINDS}
    for step in step_log:
        kind = step_kind(step)
        s, n = out[kind]
        out[kind] = (s + step[0] / 1e3, n + 1)
    return out


def timeline(results: dict, path: str) -> None:
    """Each mode's steps over the run (one panel per offline workload): step time against
    wall time, by kind, with the running batch on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, mode, r["step_log"]) for name, by_mode in results["workloads"].items()
            for mode, r in by_mode.items() if r.get("step_log")]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False, sharex=True)
    colors = {"prompt": "tab:orange", "decode": "tab:blue", "capture": "tab:red", "idle": "tab:gray"}
    for ax, (name, mode, log) in zip(axes[:, 0], runs):
        t, ends = 0.0, []
        for step in log:
            t += step[0] / 1e3
            ends.append(t)
        for kind in STEP_KINDS:
            pts = [(end, step[0]) for end, step in zip(ends, log) if step_kind(step) == kind]
            if pts:
                ax.scatter(*zip(*pts), s=4, color=colors[kind], label=kind)
        ax.set_yscale("log")
        ax.set_ylabel("step ms")
        ax.set_title(f"{name}, {mode}", fontsize=9)
        batch = ax.twinx()
        batch.plot(ends, [step[3] for step in log], color="black", linewidth=0.8)
        batch.set_ylabel("running")
        ax.legend(loc="upper left", fontsize=7, markerscale=3)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wl = results["workloads"]
    offline = [w for w in wl if w.startswith("offline")]
    online = [w for w in wl if w.startswith("online")]
    modes = results["modes"]
    # Decode throughput of the offline batches; TTFT and TPOT against the rate when online
    # workloads ran.
    fig, axes = plt.subplots(1, 3 if online else 1, figsize=(16, 4.5) if online else (6, 4.5), squeeze=False)
    axes = axes[0]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(offline))]
        bars = axes[0].bar(xs, [wl[w].get(mode, {}).get("decode_tok_s") or 0 for w in offline], width, label=mode)
        axes[0].bar_label(bars, fmt="%.0f", fontsize=8)
        if online:
            rates = [float(w.split("-")[1].removesuffix("rps")) for w in online]
            for ax, key in ((axes[1], "ttft_p99_s"), (axes[2], "tpot_p99_s")):
                ax.plot(rates, [wl[w].get(mode, {}).get(key) or float("nan") for w in online], marker="o", label=mode)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(offline))], offline)
    axes[0].set_ylabel("decode tokens/s")
    if online:
        axes[1].set_ylabel("TTFT p99 (s)")
        axes[2].set_ylabel("TPOT p99 (s)")
        for ax in axes[1:]:
            ax.set_xlabel("request rate (1/s)")
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"spin-cluster e2e ({results['device']}, GPU KV cap {results['gpu_kv_gib']} GiB)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
