"""spin-cluster bench: every registered benchmark is in the help and has its script; the results
index is current and lists every result file."""

import subprocess
import sys
from pathlib import Path

from spin_cluster.bench import BENCHMARKS
from spin_cluster.bench.harness import help_text, run
from spin_cluster.bench.paths import benchmarks_dir
from spin_cluster.bench.index import render, result_files, rows

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_benchmark():
    out = subprocess.run([sys.executable, "-m", "spin_cluster.cli", "bench", "--help"], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    for name, bench in BENCHMARKS.items():
        assert f"  {name} " in out and bench.help in out
    assert help_text().splitlines()[1] in out


def test_every_benchmark_script_exists_and_every_script_is_registered():
    scripts = {b.script for b in BENCHMARKS.values()}
    assert all((benchmarks_dir() / s).is_file() for s in scripts)
    mains = {p.name for p in benchmarks_dir().glob("*.py") if "__main__" in p.read_text()}
    assert mains <= scripts, f"benchmarks with no bench subcommand: {sorted(mains - scripts)}"


def test_retrieve_runs_the_retrieve_part_of_memory(capsys):
    # memory.py measures Retrieve (retrieve_pages) first and eviction second; the alias skips the
    # eviction part. --metadata-only runs on the CPU and still parses the alias's own argument.
    assert (BENCHMARKS["retrieve"].script, BENCHMARKS["retrieve"].argv) == ("memory.py", ("--skip-eviction",))
    assert run("retrieve", ["--metadata-only"]) == 0
    assert "Page-table metadata" in capsys.readouterr().out


def test_results_index_is_current_and_lists_every_file():
    readme = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    assert readme == render(ROOT), "stale: run spin-cluster bench index"
    for rel in result_files(ROOT / "benchmarks" / "results"):
        assert f"[{rel}]({rel})" in readme


def test_the_shared_shape_defaults_are_llama_31_8b():
    from spin_cluster.bench.args import LLAMA_31_8B_ATTENTION
    from spin_cluster.models.shapes import LLAMA_31_8B

    assert LLAMA_31_8B_ATTENTION == {"layers": LLAMA_31_8B["num_hidden_layers"],
                                     "heads": LLAMA_31_8B["num_attention_heads"],
                                     "kv_heads": LLAMA_31_8B["num_key_value_heads"],
                                     "head_dim": LLAMA_31_8B["head_dim"]}


def test_index_reads_abbreviated_names_and_lists_the_uncited(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "docs" / "a.md").write_text(
        "Results `2026-12-01-h200-eq-128k-e2e.json`, `-eq-32k-e2e.json` and `-check.log`; then\n"
        "`benchmarks/results/t/2026-12-02-cpu-vs-xeon.{json,md}` and `-run.log`, `...-cpu-ours-40s.json`.\n")
    names = ["2026-12-01-h200-eq-128k-e2e.json", "2026-12-01-h200-eq-32k-e2e.json", "2026-12-01-h200-check.log",
             "2026-12-02-cpu-vs-xeon.json", "2026-12-02-cpu-vs-xeon-run.log", "2026-12-02-cpu-ours-40s.json",
             "2026-12-02-cpu-other.log"]
    (tmp_path / "benchmarks" / "results" / "t").mkdir(parents=True)
    for name in names:
        (tmp_path / "benchmarks" / "results" / "t" / name).write_text("x")
    cited = {r["file"]: r["docs"] for r in rows(tmp_path)}
    assert [f for f, docs in cited.items() if not docs] == ["t/2026-12-02-cpu-other.log"]
    text = render(tmp_path)
    assert text.endswith("* [t/2026-12-02-cpu-other.log](t/2026-12-02-cpu-other.log): names no commit\n")
