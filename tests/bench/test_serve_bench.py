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
    assert sorted(saved["runs"]) == ["dense", "spin"] and sorted(saved["ready_s"]) == ["dense", "spin"]
    for mode, runs in saved["runs"].items():
        assert list(runs) == ["8", "inf"]
        for rate, r in runs.items():
            assert r["completed"] == r["num_prompts"] == 6 and not r["truncated"], (mode, rate)
            assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 and r["tpot_p99_s"] >= r["tpot_p50_s"] > 0
            assert r["mean_running"] > 0 and r["output_throughput"] > 0
            # every prompt ran in some step, and the steps fit in the run's wall time
            assert r["prompt_steps_s"] > 0 and r["prompt_step_tok_s"] > 0 and r["decode_only_steps_s"] > 0
            assert r["prompt_steps_s"] + r["decode_only_steps_s"] <= r["duration_s"]
            assert 0 < r["goodput"] <= r["request_throughput"]
        assert saved["saturated_output_throughput"][mode] == max(r["output_throughput"] for r in runs.values())
    assert saved["runs"]["dense"]["8"]["buffer_hit_ratio"] is None  # no buffer
    table = (tmp_path / "serve.md").read_text()
    assert "| dense | 8 |" in table and "| spin | inf |" in table and "Where each run's time went" in table
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


def test_warm_up_meets_every_power_of_two_class_of_the_stream():
    bench = load("serve")
    lengths = bench["warm_lengths"](bench["length_dist"]("log-uniform:8192:131072"))
    assert lengths == [8192, 16384, 32768, 65536, 131072]
    assert bench["warm_lengths"](bench["length_dist"]("uniform:100:5000")) == [100, 128, 256, 512, 1024, 2048, 4096, 5000]
    assert bench["warm_lengths"](bench["length_dist"]("fixed:300")) == [300]


def test_tiny_changes_defaults_only():
    parse = load("serve")["parse_args"]
    args = parse(["--tiny", "--num-prompts", "2", "--max-num-seqs", "2"])
    assert (args.num_prompts, args.max_num_seqs, args.page_size) == (2, 2, 16)
    assert str(args.input_len_dist) == "log-uniform:64:384" and args.request_rate == [8.0, float("inf")]
    assert str(args.output_len_dist) == "uniform:4:16"


def _run(output_tok_s: float, prompts: int = 4) -> dict:
    """A (mode, rate) run's figures, as ``metrics`` writes them."""
    return {"num_prompts": prompts, "completed": prompts, "truncated": False, "duration_s": 10.0, "input_tokens": 400,
            "output_tokens": int(10 * output_tok_s), "request_throughput": 0.4, "output_throughput": output_tok_s,
            "total_token_throughput": 40.0 + output_tok_s, "goodput": None, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0,
            "tpot_p50_s": 0.01, "tpot_p99_s": 0.02, "decode_tok_s": 50.0, "peak_running": 4, "mean_running": 3.0,
            "preemptions": 0, "spilled_pages": 0, "buffer_hit_ratio": None}


def _serve_json(path, runs: dict, seed=0, errors=None):
    first_run = next(iter(next(iter(runs.values())).values()))
    args = {"num_prompts": first_run["num_prompts"], "seed": seed, "input_len_dist": "fixed:100", "output_len_dist": "fixed:10",
            "max_concurrency": None, "goodput": {}, "tiny": True, "gpu_kv_gib": 1, "host_kv_gib": 2, "budget": 64}
    body = {"provenance": {"commit": f"c{len(runs)}"}, "modes": list(runs), "shape": {"layers": 2}, "args": args,
            "request_rates": sorted({r for by in runs.values() for r in by}), "device": "cpu", "runs": runs,
            "saturated_output_throughput": {}, **({"errors": errors} if errors else {})}
    path.write_text(json.dumps(body))
    return str(path)


def test_runs_made_apart_merge_into_one_report(tmp_path):
    dense = _serve_json(tmp_path / "dense.json", {"dense": {"inf": _run(100.0), "0.5": _run(60.0)}},
                        errors={"spin": "ValueError: did not fit"})
    spin = _serve_json(tmp_path / "spin.json", {"spin": {"inf": _run(250.0)}})
    merged = load("serve")["main"](["--merge", dense, spin, "--out", str(tmp_path / "both")])
    assert merged["request_rates"] == ["0.5", "inf"]  # by rate, not by file
    assert list(merged["runs"]["dense"]) == ["0.5", "inf"] and list(merged["runs"]["spin"]) == ["inf"]
    assert merged["saturated_output_throughput"] == {"dense": 100.0, "spin": 250.0}
    assert "errors" not in merged  # spin's engine error is from a file whose run of it is elsewhere
    assert [m["provenance"]["commit"] for m in merged["merged_from"]] == ["c1", "c1"]
    saved = json.loads((tmp_path / "both" / "serve.json").read_text())
    assert saved["runs"] == merged["runs"] and saved["provenance"]["commit"]
    table = (tmp_path / "both" / "serve.md").read_text()
    assert "| dense | 0.5 |" in table and "| spin | inf |" in table and "dense 100.0, spin 250.0" in table
    assert (tmp_path / "both" / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_of_different_streams_do_not_merge(tmp_path):
    a = _serve_json(tmp_path / "a.json", {"dense": {"inf": _run(100.0)}})
    b = _serve_json(tmp_path / "b.json", {"spin": {"inf": _run(250.0)}}, seed=1)
    with pytest.raises(SystemExit, match="seed differ"):
        load("serve")["main"](["--merge", a, b, "--out", str(tmp_path / "both")])


def test_rates_of_different_prompt_counts_merge_but_one_rate_never_differs(tmp_path):
    # A slow rate fills a device call with fewer requests; every mode at that rate must see the same ones.
    fast = _serve_json(tmp_path / "fast.json", {"dense": {"inf": _run(100.0, prompts=8)}})
    slow = _serve_json(tmp_path / "slow.json", {"dense": {"0.5": _run(60.0, prompts=4)}})
    merged = load("serve")["main"](["--merge", fast, slow, "--out", str(tmp_path / "both")])
    assert {r: run["num_prompts"] for r, run in merged["runs"]["dense"].items()} == {"0.5": 4, "inf": 8}
    assert "prompts per rate 0.5: 4, inf: 8" in (tmp_path / "both" / "serve.md").read_text()
    other = _serve_json(tmp_path / "other.json", {"spin": {"0.5": _run(90.0, prompts=6)}})
    with pytest.raises(SystemExit, match="rate 0.5: not the same requests"):
        load("serve")["main"](["--merge", fast, slow, other, "--out", str(tmp_path / "three")])
