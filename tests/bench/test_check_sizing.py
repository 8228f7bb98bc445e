"""spin-cluster bench check-sizing on the CPU: the bundled configs build with no KV size at a
tiny model shape and serve requests of their context; a config whose fixed GPU size cannot
hold one request's selected pages fails with the engine's error, exit status 1."""

import json

import pytest

from spin_cluster.bench.harness import run


@pytest.mark.parametrize("config", ["spin", "spin-quest"])
def test_a_bundled_config_sizes_itself_and_serves_its_context(config, smollm2_path, capsys, tmp_path):
    out_json = tmp_path / "sizing.json"
    assert run("check-sizing", ["--device", "cpu", "--shape", "tiny", "--context", "4096", "--max-tokens", "3",
                                "--config", config, "--tokenizer", smollm2_path, "--out", str(out_json)]) == 0
    saved = json.loads(out_json.read_text())
    assert saved["ok"] and saved["kv_cache_gib"] is None and saved["tokens"] == {"r0": 3, "r1": 3}
    assert saved["buffer_slots"] > 0 and sum(saved["home_pages"].values()) > 0
    assert ": ok" in capsys.readouterr().out


def test_a_gpu_size_too_small_is_the_engines_error(smollm2_path, capsys, tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text("cache: {kind: offloaded, kv_cache_gib: 0.00001, host_kv_gib: 0.1}\n"
                     "sparse: {algorithm: quest, budget: 0.25}\n")
    out_json = tmp_path / "sizing.json"
    assert run("check-sizing", ["--device", "cpu", "--shape", "tiny", "--context", "4096", "--config", str(small),
                                "--tokenizer", smollm2_path, "--out", str(out_json)]) == 1
    assert "cannot hold one request's selected pages" in json.loads(out_json.read_text())["error"]
    assert "does not build" in capsys.readouterr().out
