"""spin-cluster bench e2e at toy size on the CPU: every mode and workload runs and is reported
(its figures are GPU ones)."""

import json
import sys
from pathlib import Path

import pytest

from spin_cluster.bench.harness import load, run


@pytest.mark.slow
def test_e2e_tiny_runs_every_mode_and_workload(tmp_path):
    assert run("e2e", ["--tiny", "--deadline-s", "600", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["provenance"]["commit"]
    assert len(saved["workloads"]) == 5  # two offline lengths, three rates
    for name, by_mode in saved["workloads"].items():
        assert sorted(by_mode) == sorted(load("e2e")["MODES"]), name
        for mode, r in by_mode.items():
            assert r["finished"] == r["requests"] == 3 and not r["truncated"], (name, mode)
            assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 and r["tpot_p99_s"] >= r["tpot_p50_s"] > 0
    offline = saved["workloads"]["offline-384"]
    # No buffer: nothing is ever a hit. Spin keeps pages between steps.
    for mode in ("dense-offload", "sparse-no-buffer"):
        assert offline[mode]["buffer_hits_total"] == 0 < offline[mode]["buffer_misses_total"]
    assert offline["spin"]["buffer_hits_total"] > offline["spin"]["buffer_misses_total"]
    assert "| offline-384 | spin |" in (tmp_path / "e2e.md").read_text()
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


def test_e2e_workloads_pick_a_subset_and_unknown_names_are_refused(tmp_path, capsys):
    assert run("e2e", ["--tiny", "--workloads", "offline-1M", "--out", str(tmp_path)]) == 1
    assert "unknown workload" in capsys.readouterr().err
    assert run("e2e", ["--tiny", "--modes", "spin", "--workloads", "online-16rps", "--out", str(tmp_path),
                       "--algorithm", "labels", "--resident-margin", "0.5", "--per-head-shares"]) == 0
    result = json.loads((tmp_path / "e2e.json").read_text())
    assert list(result["workloads"]) == ["online-16rps"] and list(result["workloads"]["online-16rps"]) == ["spin"]
    bench = load("e2e")
    args = bench["parse_args"](["--tiny", "--resident-margin", "0.5"])
    assert bench["mode_config"]("spin", args, "m", 512, {"num_hidden_layers": 2, "num_key_value_heads": 2})["sparse"]["options"]["resident_margin"] == 0.5
    args = bench["parse_args"](["--tiny", "--no-per-head-shares", "--buffer-share", "4"])
    cache = bench["mode_config"]("spin", args, "m", 512, {"num_hidden_layers": 2, "num_key_value_heads": 2})["cache"]
    assert cache["kind"] == "offloaded" and cache["buffer_share"] == 4.0
    assert bench["mode_buffer_policy"]("spin", args).per_head_shares is False
    # The offload baselines reuse no page between steps; spin and dense keep the default buffer.
    assert [bench["mode_buffer_policy"](m, args).reuse for m in bench["MODES"]] == [True, False, False, True]
    args = bench["parse_args"](["--tiny", "--coarse-pages", "16", "--coarse-factor", "2"])
    options = bench["mode_config"]("spin", args, "m", 512, {"num_hidden_layers": 2, "num_key_value_heads": 2})["sparse"]["options"]
    # spin's S-HPLB-style budgets, [layers][KV heads], beside the algorithm's own options
    budgets = options.pop("per_head_budgets")
    assert len(budgets) == 2 and all(len(row) == 2 for row in budgets)
    assert options == {"index_dtype": "bfloat16", "coarse_pages": 16, "coarse_factor": 2, "coarse_split": True}
    args = bench["parse_args"](["--tiny", "--coarse-pages", "16", "--no-coarse-split"])
    options = bench["mode_config"]("spin", args, "m", 512, {"num_hidden_layers": 2, "num_key_value_heads": 2})["sparse"]["options"]
    assert options["coarse_split"] is False
    args = bench["parse_args"](["--tiny", "--algorithm", "labels", "--sparse-option", "channels=0.5",
                                "--sparse-option", "index_dtype=float8_e4m3fn"])
    options = bench["mode_config"]("spin", args, "m", 512, {"num_hidden_layers": 2, "num_key_value_heads": 2})["sparse"]["options"]
    assert options.pop("per_head_budgets") and options == {"index_dtype": "float8_e4m3fn", "channels": 0.5}


def test_tpot_counts_requests_the_deadline_cut_off():
    from types import SimpleNamespace

    bench = load("e2e")
    RT = bench["RequestTimes"]
    engine = SimpleNamespace(last_stats=SimpleNamespace(buffer_hits_total=0, buffer_misses_total=0),
                             runner=SimpleNamespace(graphs=None))
    times = [RT(arrival_s=0.0, first_token_s=1.0, last_token_s=3.0, finished_s=3.0, num_output=5),  # 0.5 s/token
             RT(arrival_s=0.0, first_token_s=2.0, last_token_s=6.0, num_output=3),  # cut off: 2 s/token so far
             RT(arrival_s=0.0)]  # never started
    r = bench["summarize"](times, [], 10.0, True, engine)
    assert r["finished"] == 1 and r["tpot_p50_s"] is not None
    assert sorted([r["tpot_p50_s"], r["tpot_p99_s"]])[1] > 1.9  # the cut-off request is in


def test_e2e_sparse_prefill_runs_the_sparse_modes_block_sparse(tmp_path):
    bench = load("e2e")
    shape = {"num_hidden_layers": 2, "num_key_value_heads": 2}
    args = bench["parse_args"](["--tiny", "--sparse-prefill", "0.25"])
    assert "prefill" not in bench["mode_config"]("dense", args, "m", 512, shape)["sparse"]
    for mode in ("sparse-no-buffer", "spin"):
        prefill = bench["mode_config"](mode, args, "m", 512, shape)["sparse"]["prefill"]
        assert prefill["algorithm"] == "block" and prefill["options"]["budgets"] == "per_head"
        fractions = [f for row in prefill["options"]["per_head_budgets"] for f in row]
        assert len(fractions) == 4 and abs(sum(fractions) / 4 - 0.25) < 0.01
    assert run("e2e", ["--tiny", "--modes", "spin", "--workloads", "offline-384", "--sparse-prefill", "0.25",
                       "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "e2e.json").read_text())["workloads"]["offline-384"]["spin"]
    assert r["finished"] == r["requests"] == 3 and not r["truncated"]
    report = (tmp_path / "e2e.md").read_text()
    assert "prefill block-sparse (0.25 of the blocks)" in report
    # Every step is logged: the split of the run's time adds up to its wall time, and the timeline is drawn.
    split = bench["e2e_report"].time_split(r["step_log"])
    assert split["prompt"][1] >= 1 and split["decode"][1] >= 1 and "Where the time went" in report
    assert abs(sum(s for s, _ in split.values()) - r["wall_s"]) < 0.1 * r["wall_s"] + 0.05
    assert (tmp_path / "e2e-timeline.png").stat().st_size > 0


def test_e2e_qwen_shape_fp8_host_and_prefill_share(tmp_path):
    """--shape qwen2.5-32b builds a Qwen2 model (toy sizes with --tiny); --host-kv-dtype
    reaches Spin's cache."""
    bench = load("e2e")
    shape = {"num_hidden_layers": 2, "num_key_value_heads": 2}
    args = bench["parse_args"](["--tiny", "--host-kv-dtype", "fp8"])
    spin, dense = (bench["mode_config"](m, args, "m", 512, shape) for m in ("spin", "dense"))
    assert spin["cache"]["host_kv_dtype"] == "fp8" and "host_kv_dtype" not in dense["cache"]
    assert run("e2e", ["--tiny", "--shape", "qwen2.5-32b", "--modes", "dense", "spin", "--workloads", "offline-384",
                       "--host-kv-dtype", "fp8", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["shape"]["architectures"] == ["Qwen2ForCausalLM"] and saved["shape"]["hidden_size"] == 64
    for r in saved["workloads"]["offline-384"].values():
        assert r["finished"] == r["requests"] == 3 and not r["truncated"]


def test_e2e_gemma_shape_serves_its_full_attention_layers_through_spin(tmp_path):
    """--shape gemma-3-27b: toy sizes keep the layer pattern up to the first full-attention
    layer (5 sliding-window layers, then one global), dense and Spin both serve it."""
    from spin_cluster.models.shapes import GEMMA3_27B, tiny

    small = tiny(GEMMA3_27B, load("e2e")["TINY"])
    assert small["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and small["num_hidden_layers"] == 6
    assert sum(t == "full_attention" for t in GEMMA3_27B["layer_types"]) == 10
    assert run("e2e", ["--tiny", "--shape", "gemma-3-27b", "--modes", "dense", "spin", "--workloads", "offline-384",
                       "--per-head-shares", "--gpu-home-fraction", "0", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["shape"]["architectures"] == ["Gemma3ForCausalLM"]
    for r in saved["workloads"]["offline-384"].values():
        assert r["finished"] == r["requests"] == 3 and not r["truncated"]
    assert saved["workloads"]["offline-384"]["spin"]["buffer_hits_total"] > 0  # the global layer's host pages went through Spin's buffer


@pytest.mark.slow
def test_profile_step_prices_a_prompt_beside_a_decoding_batch(tmp_path):
    """spin-cluster bench decode-step --mixed N: a prompt prefilled beside the running batch,
    its steps timed and profiled; the toy cache is full, so the prompt's pages spill others."""
    assert run("decode-step", ["--tiny", "--mode", "spin", "--mixed", "100", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile-spin-256.json").read_text())
    assert result["batch"] == 2  # every request still running: none finished during the others' prefill
    assert result["host_ops"] and "engine.py" in result["eager_python"]
    mixed = result["mixed"]
    assert mixed["host_ops"] and "step" in mixed["python"]
    assert 0 < mixed["profiled_wall_s"] and mixed["gaps"] is None  # GPU gaps: CUDA only
    assert mixed["prompt_tokens"] == 100 and 1 <= mixed["steps"] <= 64
    assert mixed["wall_s"] > 0 and mixed["kernel_s"] > 0 and mixed["parts_ms"]
    assert mixed["spilled_pages"] > 0


@pytest.mark.slow
def test_profile_step_times_a_draining_batch(tmp_path):
    """spin-cluster bench decode-step --drain N: requests of the batch end one at a time (one
    stays), each new size's first steps timed and the last size's first step profiled."""
    assert run("decode-step", ["--tiny", "--mode", "spin", "--drain", "5", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile-spin-256.json").read_text())
    drain = result["drain"]
    assert result["batch"] == 2 and [s["batch"] for s in drain["sizes"]] == [1]  # capped: one request stays
    assert all(len(s["step_s"]) == 3 and min(s["step_s"]) > 0 for s in drain["sizes"])
    assert drain["host_ops"] and "step" in drain["python"] and drain["top"] and drain["kernel_s"] > 0


def test_gpu_gaps_charges_idle_time_to_the_open_host_region():
    """profile_tools.gpu_gaps: idle time between kernels, the longest gaps named by the
    innermost labelled host region open when the GPU went idle."""
    import sys
    from types import SimpleNamespace as NS

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_tools

    def ev(name, start, end, device):
        return NS(name=name, time_range=NS(start=start, end=end), device_type=NS(name=device),
                  device_time=end - start if device == "CUDA" else 0)

    events = [ev("k1", 0, 1000, "CUDA"), ev("k2", 3000, 4000, "CUDA"), ev("k3", 4100, 5000, "CUDA"),
              ev("host:Engine.step", 0, 6000, "CPU"), ev("host:Kv.spill", 900, 2900, "CPU"),
              ev("host:Engine.step", 0, 6000, "CUDA"),  # a region's mirror on the GPU's timeline: not busy time
              ev("aten::sort", 1000, 2500, "CPU")]
    gaps = profile_tools.gpu_gaps(NS(events=lambda: events), min_ms=0.5)
    assert gaps["span_ms"] == 5.0 and abs(gaps["idle_ms"] - 2.1) < 1e-9
    assert gaps["idle_in_gaps_ms_by_region"] == {"Kv.spill": 2.0}  # the 0.1 ms gap is under min_ms
    (longest,) = gaps["longest"]
    assert longest["region"] == "Kv.spill" and longest["host_op"] == "aten::sort" and longest["after_kernel"] == "k1"


def test_rooflines_count_the_window_layers_windows():
    """A model with sliding-window layers: dense reads every full layer's context and each
    window layer's window; Spin the same windows beside its attended pages (the hybrid cache's
    Spin part answers for the budget)."""
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine
    from spin_cluster.models.shapes import GEMMA3_27B, shape_folder, tiny

    bench = load("e2e")
    shape = tiny(GEMMA3_27B, bench["TINY"])
    args = bench["parse_args"](["--tiny", "--per-head-shares"])
    folder = shape_folder(shape, 512, args.tokenizer, prefix="roofline-")
    r = {"decode_tok_s": 100.0, "peak_decode_batch": 2, "decode_steps": 0}
    got = {}
    for mode in ("dense", "spin"):
        engine = Engine(SpinConfig.from_dict(bench["mode_config"](mode, args, folder, 512, shape)), progress=False,
                        buffer_policy=bench["mode_buffer_policy"](mode, args))
        got[mode] = bench["step_roofline"](engine, r, 400, 1e12)
        layer = 2 * shape["num_key_value_heads"] * shape["head_dim"] * 4  # float32 K and V of a token
        window = sum(min(400, shape["sliding_window"]) for t in shape["layer_types"] if t == "sliding_attention")
        weights = sys.modules["e2e_roofline"].decode_weight_bytes(engine.model)
        if mode == "dense":
            assert got[mode]["hbm_bytes"] == weights + 2 * (400 * layer + window * layer)  # one full layer
            assert bench["roofline"](engine, 400, None, 1e12)["kv_bytes"] == 400 * layer + window * layer
        else:
            assert weights + 2 * window * layer < got[mode]["hbm_bytes"] < got["dense"]["hbm_bytes"]
