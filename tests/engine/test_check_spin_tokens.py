"""benchmarks/check_spin_tokens.py on the CPU: the offloaded cache (elastic shares, prefill
pages installed in the buffer) and Quest with a whole-context budget give dense's tokens, all
with pipelined decode, against plain dense decode."""

import runpy
from pathlib import Path

CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "check_spin_tokens.py"


def test_spin_paths_give_dense_tokens_on_toy_shapes(smollm2_path, capsys):
    check = runpy.run_path(str(CHECK), run_name="check")
    assert check["main"](["--device", "cpu", "--tokenizer", smollm2_path, "--max-tokens", "14"]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens as the plain loop") == 4
    assert "plain: same tokens as the plain loop; pipelined steps 0" in out
    assert "dense: same tokens as the plain loop; pipelined steps 0" not in out
