"""Evaluation results as a markdown table, a JSON file and an accuracy-vs-budget plot."""

from __future__ import annotations

from pathlib import Path

from spin_cluster import provenance
from spin_cluster.profiling.evaluate import EvalResults
from spin_cluster.profiling.methods import budget_label

FAILED_MARK = "†"


def markdown(results: EvalResults) -> str:
    """Per length: accuracy (%) per task x method, failed-densely tasks marked, and the
    average over the others; then the fidelity table, if measured."""
    c = results.config
    labels = [m.label for m in results.methods]
    parts = []
    for n in c.lengths:
        failed = results.dense_failures(n)
        lines = [f"Context {n} tokens, {c.samples_per_task} sample(s) per task; accuracy in %.", ""]
        lines.append("| task | " + " | ".join(labels) + " |")
        lines.append("|---|" + "---:|" * len(labels))
        for task in c.tasks:
            name = f"{task} {FAILED_MARK}" if task in failed else task
            lines.append(f"| {name} | " + " | ".join(_pct(results.accuracy(task, n, m)) for m in labels) + " |")
        kept = len(c.tasks) - len(failed)
        averages = " | ".join(_pct(results.average(n, m)) for m in labels)
        lines.append(f"| **average** ({kept} tasks) | {averages} |")
        if failed:
            lines += ["", f"{FAILED_MARK} fails densely (dense accuracy < {c.dense_threshold:.0%}): "
                      "left out of the average."]
        parts.append("\n".join(lines))
    if results.buffer_lookups:
        parts.append(buffer_markdown(results))
    if results.fidelity:
        parts.append(fidelity_markdown(results))
    return "\n\n".join(parts) + "\n"


def buffer_markdown(results: EvalResults) -> str:
    """Each offloaded engine's GPU-buffer hit ratio over the run (Retrieve's page lookups)."""
    lines = ["GPU buffer page lookups of the offloaded engines (decode steps of the whole run).", "",
             "| method @ contexts | lookups | hit ratio |", "|---|---:|---:|"]
    for key, looked in results.buffer_lookups.items():
        ratio = results.buffer_hit_ratio(key)
        lines.append(f"| {key} | {looked['hits'] + looked['misses']} | {_pct(ratio)} |")
    return "\n".join(lines)


def fidelity_markdown(results: EvalResults) -> str:
    lines = ["Attention output vs dense at a decode step over the prompt (mean over layers, heads, prompts).", "",
             "| context | method | prompts | relative L2 error | attention recall |", "|---:|---|---:|---:|---:|"]
    for r in results.fidelity:
        lines.append(f"| {r.length} | {r.method} | {r.num_prompts} | {r.rel_l2_error:.3f} | {r.attention_recall:.3f} |")
    return "\n".join(lines)


def write_json(results: EvalResults, path: str | Path) -> None:
    provenance.write_json(path, results.to_dict())


def plot(results: EvalResults, path: str | Path) -> None:
    """Average accuracy vs budget (fraction of the context, log scale), a line per algorithm
    (and budget mode) and dense as a dashed level; one panel per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, floor = results.config.lengths, results.config.base.sparse.budget_floor_tokens
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for series in dict.fromkeys(m.series for m in results.methods if not m.is_dense):
            points = sorted(
                (m.budget_tokens(n, floor) / n, results.average(n, m.label))
                for m in results.methods if m.series == series
            )
            points = [(x, 100 * y) for x, y in points if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=series)
        dense = results.average(n, "dense")
        if dense is not None:
            ax.axhline(100 * dense, linestyle="--", color="black", label="dense")
        ax.set_xscale("log", base=2)
        ticks = sorted({m.budget_tokens(n, floor) / n for m in results.methods if not m.is_dense})
        ax.set_xticks(ticks, [budget_label(x) for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("budget (fraction of the context, + sink + local)")
        ax.set_ylabel("average accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{n} tokens, {len(results.config.tasks) - len(results.dense_failures(n))} tasks")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"
