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
    rf = results.get("roofline")
    if rf and rf.get("fraction_of_roofline"):
        lines += ["", f"Dense batch-1 decode at {rf['context']} tokens: {1e3 * rf['measured_step_s']:.2f} ms/step, "
                  f"roofline {1e3 * rf['bound_step_s']:.2f} ms ({(rf['weight_bytes'] + rf['kv_bytes']) / 1e9:.1f} GB "
                  f"at {rf['hbm_bytes_s'] / 1e12:.2f} TB/s): {100 * rf['fraction_of_roofline']:.0f}% of roofline"]
    return "\n".join(lines) + "\n"


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
