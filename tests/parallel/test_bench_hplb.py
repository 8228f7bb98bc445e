"""The makespan benchmark's whole sequence at toy size on the CPU (its figures are GPU ones)."""

import json
import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hplb_makespan.py"


def test_bench_runs_end_to_end_on_a_stretched_profile(tmp_path):
    bench = runpy.run_path(str(BENCH), run_name="bench_hplb_makespan")
    profile = tmp_path / "budgets.json"
    profile.write_text(json.dumps({"per_head_budgets": [[64, 16, 256], [32, 32, 128]]}))
    out = tmp_path / "r.json"
    result = bench["main"]([
        "--device", "cpu", "--context", "512", "--batch", "2", "--layers", "4", "--heads", "8",
        "--kv-heads", "4", "--head-dim", "16", "--mean-budget", "64", "--ranks", "2", "4",
        "--reps", "1", "--trials", "1", "--copies", "2", "--budgets", str(profile), "--out", str(out),
    ])
    assert json.loads(out.read_text())["ranks"] == result["ranks"]
    # Layers 0-1 take the profile's row 0, layers 2-3 row 1; heads 0, 1 <- 0 and 2 <- 1, 3 <- 2.
    rows = [[r // 16 for r in row] for row in result["budgets"]["per_head"]]
    assert rows[0] == rows[1] and rows[2] == rows[3]
    assert rows[0][0] == rows[0][1] < rows[0][3] and rows[0][2] < rows[0][0]
    for r in result["ranks"]:
        assert r["model_gain"] >= 1.0 and r["greedy_imbalance"] <= r["contiguous_imbalance"]
        assert all(sorted(set(row)) == list(range(r["num_ranks"])) for row in r["greedy_placement"])


def test_head_parallel_bench_runs_every_rank_count_and_placement_on_cpu(tmp_path):
    """benchmarks/bench_head_parallel.py --tiny: gloo ranks, the Spin cache with S-HPLB
    budgets; every configuration decodes the one-rank tokens and reports its bubble."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_head_parallel.py"
    out, md = tmp_path / "hp.json", tmp_path / "hp.md"
    subprocess.run([sys.executable, str(bench), "--tiny", "--out", str(out), "--md", str(md)], check=True, timeout=300)
    result = json.loads(out.read_text())
    runs = [(r["ranks"], r["placement"]) for r in result["runs"]]
    assert runs == [(1, "one GPU"), (2, "contiguous"), (2, "greedy")]
    assert all(r["tokens_equal_1"] for r in result["runs"])
    assert all(0 <= r["bubble_ratio"] < 1 and len(r["attention_rank_s"]) == r["ranks"] for r in result["runs"])
    assert "2" in result["greedy_vs_contiguous"] and "| 2 | greedy |" in md.read_text()
