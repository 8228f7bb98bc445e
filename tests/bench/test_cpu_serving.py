"""spin-cluster bench cpu-serving without servers: guidellm's report read at the paths its 0.8.1
JSON uses, and runs summarized as median and min-max (its figures are measured ones)."""

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from spin_cluster.bench.harness import load
# The shape of a guidellm 0.8.1 report, cut to what the benchmark reads (values from a real run).
REPORT = {"benchmarks": [{"metrics": {
    "output_tokens_per_second": {"total": {"mean": 7.8}},
    "inter_token_latency_ms": {"successful": {"median": 94.2}},
    "time_to_first_token_ms": {"successful": {"median": 545.2}},
    "request_totals": {"successful": 4, "errored": 0, "incomplete": 1, "total": 5}}}]}


def _fake_guidellm(tmp_path: Path, report: dict | None, exit_code: int = 0) -> Path:
    """A stand-in ``guidellm`` that writes ``report`` where --output's path says."""
    venv = tmp_path / "guidellm"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "guidellm"
    exe.write_text("#!/usr/bin/env python3\nimport sys, json\n"
                   "args = sys.argv[1:]\n"
                   "out = next(a.split('path=')[1] for a in args if a.startswith('kind=json,path='))\n"
                   f"report = {json.dumps(report)!r}\n"
                   "open(out, 'w').write(report) if report != 'null' else None\n"
                   f"sys.stderr.write('args: ' + ' '.join(args))\nsys.exit({exit_code})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return venv


def test_a_level_reads_guidellms_report(tmp_path):
    bench = load("cpu-serving")
    args = SimpleNamespace(guidellm_venv=str(_fake_guidellm(tmp_path, REPORT)), model_dir="/models/m", seconds=5)
    row = bench["drive"](args, "http://127.0.0.1:1", "smollm2", 512, 4, tmp_path / "level.json")
    assert row == {"out_tok_s": 7.8, "itl_ms": 94.2, "ttft_ms": 545.2, "requests": 4, "errored": 0}


def test_a_failing_level_names_guidellms_error(tmp_path):
    bench = load("cpu-serving")
    args = SimpleNamespace(guidellm_venv=str(_fake_guidellm(tmp_path, None, exit_code=3)), model_dir="/m", seconds=5)
    with pytest.raises(RuntimeError, match="guidellm exited with 3: args: run --backend "
                                           "kind=openai_http,target=http://127.0.0.1:1,model=smollm2"):
        bench["drive"](args, "http://127.0.0.1:1", "smollm2", 512, 4, tmp_path / "level.json")


def test_runs_are_summarized_as_median_and_spread():
    bench = load("cpu-serving")
    level = bench["level_name"](512, 4)
    assert level == "512 in, 4 streams" and bench["level_name"](512, 1) == "512 in, 1 stream"
    runs = [{"out_tok_s": v, "itl_ms": 100.0 + v, "ttft_ms": 500.0} for v in (10.0, 14.0, 12.0)]
    summary = bench["summarize"]({"ours": {level: runs}, "vllm": {level: runs[:1]}})
    assert summary["ours"][level]["out_tok_s"] == {"median": 12.0, "min": 10.0, "max": 14.0, "runs": 3}
    assert summary["vllm"][level]["itl_ms"]["runs"] == 1
    table = bench["markdown"](summary, ["ours", "vllm"], [level])
    assert "| 512 in, 4 streams | 12.0 (10.0-14.0) | 10.0 (10.0-10.0) | 112 (110-114) |" in table


@pytest.mark.parametrize("system", ["ours", "vllm"])
def test_an_isa_cap_reaches_both_servers(system, tmp_path):
    server_command = load("cpu-serving")["server_command"]
    args = SimpleNamespace(isa="avx2", model=None, ours_config=None, vllm_venv=str(tmp_path), vllm_bind="auto",
                           model_dir="/m")
    _, env = server_command(system, args, 8000)
    assert (env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"], env["SPIN_CLUSTER_CPU_ISA"]) == ("avx2", "AVX2", "avx2")
    _, env = server_command(system, SimpleNamespace(**{**args.__dict__, "isa": "native"}), 8000)
    assert env.get("SPIN_CLUSTER_CPU_ISA") == os.environ.get("SPIN_CLUSTER_CPU_ISA")  # native: the caller's own
