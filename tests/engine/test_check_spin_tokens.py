"""benchmarks/check_spin_tokens.py on the CPU: the offloaded cache (elastic shares, prefill
pages installed in the buffer) and Quest with a whole-context budget give dense's tokens."""

import runpy
from pathlib import Path

CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "check_spin_tokens.py"


def test_spin_paths_give_dense_tokens_on_toy_shapes(smollm2_path, capsys):
    check = runpy.run_path(str(CHECK), run_name="check")
    assert check["main"](["--device", "cpu", "--tokenizer", smollm2_path, "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens as dense") == 3
