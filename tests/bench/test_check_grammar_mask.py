"""spin-cluster bench check-grammar-mask on the CPU: a constrained batch of a tiny model samples
only tokens its grammars allow, and every stopped output parses (on a GPU it also compares the
device's bitmask apply with the CPU's)."""

import pytest

from spin_cluster.bench.harness import run


@pytest.mark.slow
def test_a_constrained_batch_of_a_tiny_model_samples_only_allowed_tokens(smollm2_path, capsys):
    assert run("check-grammar-mask", ["--tokenizer", smollm2_path, "--device", "cpu"]) == 0
    assert "44 requests, 0 tokens refused, 0 stopped outputs unparsable" in capsys.readouterr().out
