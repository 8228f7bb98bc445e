"""spin-cluster bench serve: a toy request stream through dense and Spin on the CPU is served and
reported (its figures are GPU ones); the length, goodput and rate flags refuse what they cannot read."""

import json

import pytest

from spin_cluster.bench.harness import load, run


@pytest.mark.slow
def test_serve_tiny_reports_every_mode_and_rate(tmp_path):
    assert run("serve", ["--tiny", "--modes", "dense", "spin", "--request-rate", "8", "inf", "--goodput",
                         "ttft:60000", "tpot:60000", "--deadline-s", "300", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["provenance"]["commit"]
    assert sorted(saved["runs"]) == ["dense", "spin"]
    for mode, runs in saved["runs"].items():
        assert list(runs) == ["8", "inf"]
        for rate, r in runs.items():
            assert r["completed"] == r["num_prompts"] == 6 and not r["truncated"], (mode, rate)
            assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 and r["tpot_p99_s"] >= r["tpot_p50_s"] > 0
            assert r["mean_running"] > 0 and r["output_throughput"] > 0
            assert 0 < r["goodput"] <= r["request_throughput"]
        assert saved["saturated_output_throughput"][mode] == max(r["output_throughput"] for r in runs.values())
    assert saved["runs"]["dense"]["8"]["buffer_hit_ratio"] is None  # no buffer
    table = (tmp_path / "serve.md").read_text()
    assert "| dense | 8 |" in table and "| spin | inf |" in table
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags", [["--input-len-dist", "log-uniform:9:3"], ["--output-len-dist", "gauss:1:2"],
                                   ["--input-len-dist", "fixed:0"], ["--goodput", "ttft:abc"],
                                   ["--goodput", "latency:5"], ["--request-rate", "0"]])
def test_unreadable_flags_are_argparse_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        load("serve")["parse_args"](flags)
    assert e.value.code == 2
    assert f"error: argument {flags[0]}" in capsys.readouterr().err


def test_the_stream_is_seeded_and_within_its_bounds():
    bench = load("serve")
    args = bench["parse_args"](["--num-prompts", "200", "--input-len-dist", "log-uniform:100:5000",
                                "--output-len-dist", "fixed:7", "--goodput", "tpot:50", "--seed", "3"])
    assert args.goodput == {"tpot": 50.0}
    arrivals, inputs, outputs = bench["workload"](args, 2.0)
    assert (arrivals, inputs, outputs) == bench["workload"](args, 2.0)
    assert bench["workload"](args, 4.0)[1] != inputs  # each rate its own draw
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 50 < arrivals[-1] < 150  # ~199 gaps of 0.5 s
    assert all(100 <= n <= 5000 for n in inputs) and min(inputs) < 700 < max(inputs)  # log-uniform: median ~707
    assert outputs == [7] * 200
    assert bench["workload"](args, float("inf"))[0] == [0.0] * 200
    prompts = bench["prompts"](args, 2.0, inputs[:3])
    assert [len(p) for p in prompts] == inputs[:3] and prompts == bench["prompts"](args, 2.0, inputs[:3])


def test_tiny_changes_defaults_only():
    parse = load("serve")["parse_args"]
    args = parse(["--tiny", "--num-prompts", "2", "--max-num-seqs", "2"])
    assert (args.num_prompts, args.max_num_seqs, args.page_size) == (2, 2, 16)
    assert str(args.input_len_dist) == "log-uniform:64:384" and args.request_rate == [8.0, float("inf")]
    assert str(args.output_len_dist) == "uniform:4:16"
