"""Find a benchmark's script and run it with its own arguments (see the package docstring)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from spin_cluster.bench import BENCHMARKS
from spin_cluster.bench.paths import benchmarks_dir

def script_path(name: str) -> Path:
    return benchmarks_dir() / BENCHMARKS[name].script


def run(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` as ``python benchmarks/<script> [its registered argv] argv...`` would, in
    this process."""
    path = script_path(name)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *BENCHMARKS[name].argv, *argv]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return _exit_status(e)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def load(name: str) -> dict:
    """Benchmark ``name``'s script as a module, not run: its functions by name (what tests call)."""
    path = script_path(name)
    saved_path = list(sys.path)
    sys.path.insert(0, str(path.parent))
    try:
        return runpy.run_path(str(path), run_name=path.stem)
    finally:
        sys.path[:] = saved_path


def _exit_status(e: SystemExit) -> int:
    """``sys.exit(code)``'s status as the interpreter gives it: a message is printed and means 1."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def help_text() -> str:
    width = max(len(n) for n in BENCHMARKS)
    rows = [f"  {n:<{width}}  {b.help}" for n, b in BENCHMARKS.items()]
    return "benchmarks (spin-cluster bench NAME --help for each one's arguments):\n" + "\n".join(
        rows + [f"  {'index':<{width}}  regenerate benchmarks/results/README.md and the docs' headline tables (--check: fail if stale)"])


def add_bench_parser(sub) -> None:
    """``spin-cluster bench NAME [ARGS...]``: ARGS go to the benchmark unchanged."""
    p = sub.add_parser("bench", help="run a benchmark (spin-cluster bench --help lists them)",
                       description=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME", choices=[*BENCHMARKS, "index"], help="the benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(a) -> int:
    if a.name == "index":
        from spin_cluster.bench.index import main as index_main
        return index_main(a.args)
    return run(a.name, a.args)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m spin_cluster.bench NAME ...`` where the console script is not installed."""
    p = argparse.ArgumentParser(prog="spin-cluster")
    add_bench_parser(p.add_subparsers(metavar="COMMAND"))
    a = p.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return a.func(a)
