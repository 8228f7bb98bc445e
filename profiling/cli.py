"""``spin-cluster eval``: accuracy of sparse attention on RULER-style tasks.

    spin-cluster eval --lengths 2048 --samples 3 --algorithms dense streaming quest \\
        --budgets 0.125 0.0625 0.03125 --out results.json --plot accuracy.png --fidelity

Prints a markdown table per length; ``--out`` writes every sample's output as JSON,
``--plot`` average accuracy vs budget as a PNG. The engines start from the eval's settings, or
from a serving config (``--base-config spin``); each engine flag (``--max-batch``, ``--page-size``,
...) sets one key of that base (``ENGINE_FLAGS``). Hooked into the main parser by
``add_eval_parser(subparsers)``.

    spin-cluster profile --lengths 2048 --samples 2 --out profile.json --plot heatmap.png

``spin-cluster profile`` measures a model's per-head sparsity profile (S-HPLB,
``head_profile.py``); ``add_profile_parser(subparsers)`` registers it before ``profile
train-gate`` joins it as an ACTION.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from spin_cluster.config import option_pairs
from spin_cluster.profiling import ruler
from spin_cluster.profiling.evaluate import EvalConfig, base_config

# The engine flags of `eval`: each sets one key of the base config (``EvalConfig.base``); a flag
# left out keeps the base's value (the eval's defaults, or --base-config's).
ENGINE_FLAGS = {
    "model": ("model", "path"), "device": ("model", "device"), "dtype": ("model", "dtype"),
    "hf_overrides": ("model", "hf_overrides"), "page_size": ("cache", "page_size"),
    "buffer_share": ("cache", "buffer_share"), "host_kv_dtype": ("cache", "host_kv_dtype"),
    "max_batch": ("scheduler", "max_num_seqs"), "max_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "sink_tokens": ("sparse", "sink_tokens"), "local_tokens": ("sparse", "local_tokens"),
    "dense_layers": ("sparse", "dense_layers"), "budget_floor": ("sparse", "budget_floor_tokens"),
}


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``add_subparsers()`` object of the main parser."""
    d = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(EvalConfig)})  # no validation
    base = base_config()

    def engine(dest: str) -> str:  # "(section.key; default: the eval's)", for a flag's help
        section, key = ENGINE_FLAGS[dest]
        return f"{section}.{key}; default: {getattr(getattr(base, section), key)}"

    p = subparsers.add_parser("eval", help="accuracy of sparse attention on RULER-style tasks",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--base-config", default=None, metavar="NAME|PATH",
                   help="the engines' settings from a serving config, a bundled one by name (default, spin, "
                        "spin-quest, spin-fast) or a YAML file, as `spin-cluster serve --config` reads it; the "
                        "flags below override it. Of its sparse section the sparse methods take sink_tokens, "
                        "local_tokens, budget_floor_tokens and dense_layers (--configs runs a config's own "
                        "sparse method). Default: the eval's settings")
    p.add_argument("--model", default=None, help="model folder (model.path; default: the prepared default model)")
    p.add_argument("--tasks", nargs="+", default=list(d.tasks), metavar="TASK",
                   help=f"of: {', '.join(ruler.task_names())} (default: all)")
    p.add_argument("--lengths", nargs="+", type=int, default=list(d.lengths), metavar="TOKENS",
                   help="context lengths, prompt + answer (default: %(default)s)")
    p.add_argument("--samples", type=int, default=d.samples_per_task,
                   help="samples per task and length (default: %(default)s)")
    p.add_argument("--algorithms", nargs="+", default=list(d.algorithms), metavar="NAME",
                   help="registered sparse algorithms; dense always runs: it is the reference")
    p.add_argument("--configs", nargs="+", default=list(d.configs), metavar="NAME",
                   help="bundled serving configs (spin, spin-quest, spin-fast) or YAML files, each run with its "
                        "own sparse section, page size and host dtype, beside --algorithms")
    p.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                   help="model.hf_overrides of every engine, e.g. YaRN past 32K on Qwen2.5: "
                        '\'{"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'')
    p.add_argument("--budgets", nargs="+", type=float, default=list(d.budgets), metavar="B",
                   help="middle tokens per head: fractions (0, 1) of the context or token counts")
    p.add_argument("--budget-modes", nargs="+", default=list(d.budget_modes), metavar="MODE",
                   help="how scored algorithms spread each budget over heads, at one total: uniform "
                        "(top-k), top_p (online, --top-p), maxmin (S-HPLB, --profile) (default: uniform)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="attention mass of top_p mode (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="JSON", help="head profile of maxmin mode (`spin-cluster profile`)")
    p.add_argument("--floor-fraction", type=float, default=d.floor_fraction,
                   help="maxmin: each head keeps at least this share of the uniform budget (default: %(default)s)")
    p.add_argument("--budget-floor", type=int, default=None, metavar="TOKENS",
                   help="sparse methods: a context at or under it runs dense, a fractional budget takes this many "
                        f"tokens at least; 2048: as the bundled spin config ({engine('budget_floor')}, off)")
    p.add_argument("--sink-tokens", type=int, default=None, help=f"sparse methods ({engine('sink_tokens')})")
    p.add_argument("--local-tokens", type=int, default=None, help=f"sparse methods ({engine('local_tokens')})")
    p.add_argument("--dense-layers", type=int, default=None,
                   help=f"sparse methods: the first N layers attend densely ({engine('dense_layers')})")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="sparse.options of the sparse methods, e.g. score_block_tokens=4 (repeatable)")
    p.add_argument("--page-size", type=int, default=None,
                   help=f"tokens per KV page, the unit every Select picks ({engine('page_size')})")
    p.add_argument("--buffer-share", type=float, default=None,
                   help="offloaded methods: GPU buffer share per head, in multiples of the pages a step "
                        f"selects ({engine('buffer_share')})")
    p.add_argument("--resident-margin", type=float, default=None,
                   help="offloaded methods that score pages: Select's hysteresis for pages the GPU buffer holds, "
                        "in nats (sparse.options.resident_margin; default: 0, off)")
    p.add_argument("--host-kv-dtype", choices=["auto", "fp8"], default=None,
                   help="offloaded methods: their pages all live on the host, so fp8 touches every page they "
                        f"read ({engine('host_kv_dtype')})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="greedy tokens per answer")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"requests running at once per engine ({engine('max_batch')})")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step, the prefill chunk size ({engine('max_batched_tokens')})")
    p.add_argument("--dense-threshold", type=float, default=d.dense_threshold,
                   help="dense accuracy below this marks a task as failed densely (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None, help=f"({engine('device')})")
    p.add_argument("--dtype", default=None, help=f"({engine('dtype')})")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (model.cuda_graphs false): every decode step runs eagerly (as vLLM's flag)")
    p.add_argument("--out", default=None, metavar="JSON", help="write all results here")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot accuracy vs budget here")
    p.add_argument("--fidelity", action="store_true",
                   help="also measure the attention-output error vs dense (one prompt per task and length)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_eval)
    return p


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The ``EvalConfig`` of parsed arguments: --base-config with the engine flags given laid
    over it (``ENGINE_FLAGS``); raises ValueError (unknown algorithm or task, bad numbers, a bad
    engine setting named by its config key) before any model is loaded."""
    flags: dict[str, dict] = {}
    for dest, (section, key) in ENGINE_FLAGS.items():
        if getattr(args, dest) is not None:
            flags.setdefault(section, {})[key] = getattr(args, dest)
    if args.enforce_eager:
        flags.setdefault("model", {})["cuda_graphs"] = False
    options = option_pairs(args.option)
    if args.resident_margin is not None:
        options["resident_margin"] = args.resident_margin
    return EvalConfig(
        base=base_config(args.base_config).replace(**flags), tasks=tuple(args.tasks), lengths=tuple(args.lengths),
        samples_per_task=args.samples, algorithms=tuple(args.algorithms), budgets=tuple(args.budgets),
        configs=tuple(args.configs), budget_modes=tuple(args.budget_modes), top_p=args.top_p,
        profile_path=args.profile, floor_fraction=args.floor_fraction, max_tokens=args.max_tokens,
        dense_threshold=args.dense_threshold, seed=args.seed, algorithm_options=options,
    )


def run_eval(args: argparse.Namespace) -> int:
    from spin_cluster.profiling import fidelity, report
    from spin_cluster.profiling.evaluate import evaluate

    config = eval_config(args)
    checkpoint = (lambda partial: report.write_json(partial, args.out)) if args.out else None
    results = evaluate(config, progress=not args.quiet, checkpoint=checkpoint)
    if args.fidelity:
        results.fidelity = fidelity.measure(config, progress=not args.quiet)
    print(report.markdown(results), end="")
    print(f"\n{len(results.samples)} generations in {results.elapsed_s:.0f} s")
    if results.method_s:
        print("seconds per method: " + ", ".join(f"{k} {v:.0f}" for k, v in results.method_s.items()))
    if args.out:
        report.write_json(results, args.out)
    if args.plot:
        report.plot(results, args.plot)
    return 0


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` on the main parser: without an ACTION it measures the head profile
    (S-HPLB); ACTIONs such as ``train-gate`` (``add_train_gate_parser``) join its subparsers."""
    from spin_cluster.profiling.head_profile import FAMILIES, ProfileConfig

    d = ProfileConfig()
    p = subparsers.add_parser(
        "profile", help="offline profiling: per-head sparsity (S-HPLB), or an ACTION such as train-gate",
        description="Measure the attention mass each (layer, KV head) recovers at each budget, on "
                    "calibration prompts (RULER-style tasks and docstring prose); write it as JSON.")
    p.add_argument("--model", default=None, help="model folder (default: the prepared default model)")
    p.add_argument("--out", default="profile.json", metavar="JSON", help="profile to write (default: %(default)s)")
    p.add_argument("--input", default=None, metavar="JSON",
                   help="summarize (and --plot) this existing profile instead of measuring one")
    p.add_argument("--plot", default=None, metavar="PNG", help="per-(layer, KV head) heatmap of the profile")
    p.add_argument("--lengths", nargs="+", type=int, default=list(d.lengths), metavar="TOKENS",
                   help="prompt lengths (default: %(default)s)")
    p.add_argument("--samples", type=int, default=d.samples, help="prompts per task and length (default: %(default)s)")
    p.add_argument("--queries", type=int, default=d.queries,
                   help="decode-like query positions per prompt, its last ones (default: %(default)s)")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(d.families),
                   help="calibration prompt families (default: all)")
    p.add_argument("--coverage", type=float, default=0.9,
                   help="attention mass whose per-head need the summary and heatmap show (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="must equal cache.page_size")
    p.add_argument("--sink-tokens", type=int, default=d.sink_tokens)
    p.add_argument("--local-tokens", type=int, default=d.local_tokens)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--seed", type=int, default=d.seed, help="first calibration seed (default: %(default)s)")
    p.add_argument("--select", default=None, metavar="ALGORITHM",
                   help="rank the middle pages as this Select does (e.g. quest: the one budgets are for); "
                        "default: the oracle (true mass)")
    p.add_argument("--answer-steps", action="store_true",
                   help="read the task prompts' queries at their answer steps (teacher-forced), not their last positions")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_subparsers(metavar="ACTION")
    p.set_defaults(func=run_profile)
    return p


def run_profile(args: argparse.Namespace) -> int:
    from spin_cluster.hplb.profile import load_profile, save_profile
    from spin_cluster.profiling import head_profile

    if not 0 < args.coverage <= 1:
        raise ValueError(f"--coverage {args.coverage}: use an attention mass in (0, 1]")
    if args.input:
        profile = load_profile(args.input, model_path=args.model)
    else:
        config = head_profile.ProfileConfig(
            model_path=args.model, lengths=tuple(args.lengths), samples=args.samples, queries=args.queries,
            families=tuple(args.families), page_size=args.page_size, sink_tokens=args.sink_tokens,
            local_tokens=args.local_tokens, device=args.device, dtype=args.dtype, seed=args.seed,
            select=args.select, answer_steps=args.answer_steps,
        )
        profile = head_profile.profile_model(config, progress=not args.quiet)
        save_profile(profile, args.out)
        print(f"wrote {args.out}")
    print(head_profile.summary_markdown(profile, args.coverage), end="")
    if args.plot:
        head_profile.plot_heatmap(profile, args.plot, args.coverage)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m spin_cluster.profiling.cli eval|profile ...``: the same commands on their own."""
    import sys

    parser = argparse.ArgumentParser(prog="spin-cluster")
    commands = parser.add_subparsers(metavar="COMMAND", required=True)
    add_eval_parser(commands)
    add_profile_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
