"""The makespan benchmark's whole sequence at toy size on the CPU (its figures are GPU ones)."""

import json
import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hplb_makespan.py"


def test_bench_runs_end_to_end_on_a_stretched_profile(tmp_path):
    from spin_cluster.cli import main as cli_main

    profile = tmp_path / "budgets.json"
    profile.write_text(json.dumps({"per_head_budgets": [[64, 16, 256], [32, 32, 128]]}))
    out = tmp_path / "r.json"
    assert cli_main(["bench", "hplb-makespan",
        "--device", "cpu", "--context", "512", "--batch", "2", "--layers", "4", "--heads", "8",
        "--kv-heads", "4", "--head-dim", "16", "--mean-budget", "64", "--ranks", "2", "4",
        "--reps", "1", "--trials", "1", "--copies", "2", "--budgets", str(profile), "--out", str(out),
    ]) == 0
    saved = json.loads(out.read_text())
    result = saved
    assert saved["ranks"] == result["ranks"] and saved["provenance"]["commit"]
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
    imbalance = {r["placement"]: r["imbalance"] for r in result["runs"]}  # of the cost model
    assert imbalance["one GPU"] == 0 and 0 <= imbalance["greedy"] <= imbalance["contiguous"]
    assert result["greedy_vs_contiguous"]["2"]["model_gain"] >= 1.0 and "(cost model: " in md.read_text()


def test_head_parallel_bench_records_a_failed_configuration_and_goes_on(tmp_path):
    """A configuration whose ranks hang or fail is a row with its error; the sweep goes on."""
    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "bench_head_parallel.py"),
                           run_name="bench_head_parallel")
    main = bench["main"]

    def fake_run_config(config, placement, prompts, steps, num_ranks, device_type, timeout_s):
        if num_ranks == 2 and placement.method == "contiguous":
            raise TimeoutError(f"{num_ranks} ranks did not finish within {timeout_s:.0f} s")
        step = [(0.01, [0.004 / num_ranks] * num_ranks, 0.0001)] * 3
        return {"placement": placement.to_dict(), "prefill_s": 1.0, "decode": step, "tokens": [[1, 2]],
                "graph_replays": 0}

    main.__globals__["run_config"] = fake_run_config
    out, md = tmp_path / "hp.json", tmp_path / "hp.md"
    result = main(["--tiny", "--ranks", "1", "2", "--out", str(out), "--md", str(md), "--timeout-s", "7"])
    rows = {(r["ranks"], r["placement"]): r for r in result["runs"]}
    assert list(rows) == [(1, "one GPU"), (2, "contiguous"), (2, "greedy")]
    assert rows[2, "contiguous"]["error"] == "TimeoutError: 2 ranks did not finish within 7 s"
    assert rows[2, "greedy"]["tokens_equal_1"] and rows[2, "greedy"]["speedup_vs_1"] == 1.0
    assert result["greedy_vs_contiguous"] == {}  # nothing to compare against
    assert "| 2 | contiguous | failed: TimeoutError" in md.read_text()
    assert json.loads(out.read_text())["runs"][1]["error"].startswith("TimeoutError")
