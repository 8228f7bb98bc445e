"""spin-cluster bench check-spin-tokens on the CPU: the offloaded cache (elastic shares, prefill
pages installed in the buffer), Quest with a whole-context budget, and the same with a GPU
home too small for the prompts (spills) give dense's tokens, all with pipelined decode, against
plain dense decode."""

import json

from spin_cluster.bench.harness import run


def test_spin_paths_give_dense_tokens_on_toy_shapes(smollm2_path, capsys, tmp_path):
    out_json = tmp_path / "check.json"
    assert run("check-spin-tokens", ["--device", "cpu", "--tokenizer", smollm2_path, "--max-tokens", "14",
                                     "--out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens as the plain loop") == 5
    assert "plain: same tokens as the plain loop; pipelined steps 0" in out
    assert "dense: same tokens as the plain loop; pipelined steps 0" not in out
    saved = json.loads(out_json.read_text())
    assert saved["provenance"]["command"].endswith(f"check_spin_tokens.py --device cpu --tokenizer {smollm2_path} "
                                                   f"--max-tokens 14 --out {out_json}")
    assert list(saved["engines"]) == ["plain", "dense", "offloaded", "quest", "spilled"]
    assert saved["engines"]["spilled"]["spilled_pages"] > 0 == saved["engines"]["quest"]["spilled_pages"]
    assert all(e["same_tokens"] for e in saved["engines"].values())
    assert saved["engines"]["plain"]["pipelined_steps"] == 0 < saved["engines"]["dense"]["pipelined_steps"]
    assert [len(t) for t in saved["reference_tokens"]] == [14, 9, 3]
