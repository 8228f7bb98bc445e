"""The arguments the benchmark scripts share, each group added by one function.

A script calls the groups it takes and passes its own defaults where they differ, so a flag keeps
its name, default and meaning in every script (benchmarks/gpu_*.sh call them by these flags):

    model     --model DIR                   a checkpoint folder; model_path() resolves the default
    tokenizer --tokenizer DIR               tokenizer files for a shape-only model folder
    shape     --heads --kv-heads --head-dim [--layers] --page-size: attention shapes, Llama-3.1-8B's
    sparse    --algorithm NAME, --budget N  the Select and its middle-token budget (tokens; the
                                            prefill benchmarks' --budget, a block fraction, stays theirs)
    device    --device NAME
    out       --out JSON [--md MD] (save() writes it), or --out DIR for several files

Every JSON result goes through ``spin_cluster.provenance.write_json`` (commit, command, GPU, date).
An app config (cpu_serving.py's --ours-config YAML) is one script's flag and stays there.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# Llama-3.1-8B's attention shapes (spin_cluster.models.shapes.LLAMA_31_8B, which tests/bench checks
# this against). Not imported from there: spin_cluster.models imports the kernels, which a kernel
# benchmark run from a source checkout loads from its kernels/ folder itself, after parsing.
LLAMA_31_8B_ATTENTION = {"layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}

# The Selects that run inside a decode CUDA graph, the ones the decode benchmarks time.
GRAPH_SAFE_ALGORITHMS = ("quest", "labels")


def add_model(ap: argparse.ArgumentParser, *, required: bool = False, help: str | None = None) -> None:
    default = "" if required else " (default: the prepared default model)"
    ap.add_argument("--model", default=None, required=required, metavar="DIR",
                    help=help or f"model folder{default}")


def model_path(args: argparse.Namespace) -> str:
    """``--model``, else the prepared default model's folder (downloaded on first use)."""
    if args.model:
        return args.model
    from spin_cluster.model_store import prepare_default_model

    return str(prepare_default_model())


def add_tokenizer(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="folder with tokenizer.json (default: the prepared default model's)")


def add_shape(ap: argparse.ArgumentParser, *, page_size: int, layers: bool = False) -> None:
    """Attention shapes of a synthetic cache, Llama-3.1-8B's by default; ``page_size`` in tokens."""
    if layers:
        ap.add_argument("--layers", type=int, default=LLAMA_31_8B_ATTENTION["layers"], help="decoder layers L")
    ap.add_argument("--heads", type=int, default=LLAMA_31_8B_ATTENTION["heads"], help="query heads H")
    ap.add_argument("--kv-heads", type=int, default=LLAMA_31_8B_ATTENTION["kv_heads"], help="KV heads Hkv")
    ap.add_argument("--head-dim", type=int, default=LLAMA_31_8B_ATTENTION["head_dim"], help="head dim D")
    ap.add_argument("--page-size", type=int, default=page_size, help="tokens per page S")


def add_algorithm(ap: argparse.ArgumentParser, *, default: str = "quest",
                  choices: tuple[str, ...] | None = GRAPH_SAFE_ALGORITHMS, help: str | None = None) -> None:
    ap.add_argument("--algorithm", default=default, choices=choices,
                    help=help or "the Select (sparse.algorithm)")


def add_budget_tokens(ap: argparse.ArgumentParser, *, help: str = "mean middle tokens per KV head") -> None:
    """``--budget``: tokens Select keeps per KV head between the sink and local windows."""
    ap.add_argument("--budget", type=int, default=2048, help=help)


def add_device(ap: argparse.ArgumentParser, *, default: str) -> None:
    ap.add_argument("--device", default=default, help=f"torch device (default: {default})")


def add_out(ap: argparse.ArgumentParser, *, md: bool = False, help: str = "write the result as JSON here") -> None:
    """``--out JSON`` (nothing written without it), and ``--md MD`` for a markdown table."""
    ap.add_argument("--out", default=None, metavar="JSON", help=help)
    if md:
        ap.add_argument("--md", default=None, metavar="MD", help="write the markdown table here")


def add_out_folder(ap: argparse.ArgumentParser) -> None:
    """``--out DIR``: a benchmark that writes several files (JSON, markdown, plots) names them there."""
    ap.add_argument("--out", default=".", metavar="DIR", help="folder the result files go to (made if missing)")


def save(args: argparse.Namespace, result: dict[str, Any] | list, indent: int = 1) -> None:
    """``result`` with its provenance as JSON at ``--out``, when given."""
    if args.out:
        write_result(args.out, result, indent)


def write_result(path: str, result: dict[str, Any] | list, indent: int = 1) -> None:
    """``provenance.write_json``, making the folder first."""
    from spin_cluster.provenance import write_json  # torch: only once there is something to write

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_json(path, result, indent)
