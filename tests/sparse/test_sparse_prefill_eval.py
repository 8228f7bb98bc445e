"""The sparse-prefill dimension of the accuracy harness: methods, engine configs, calibration."""

import pytest

from spin_cluster.profiling.evaluate import EvalConfig, evaluate, spin_config
from spin_cluster.profiling.methods import Method, make_methods


def test_prefill_methods_and_labels():
    methods = make_methods(["dense"], [], ["uniform", "hplb"], 0.25)
    assert [m.label for m in methods] == ["dense", "dense + prefill uniform 1/4", "dense + prefill hplb 1/4"]
    with pytest.raises(ValueError, match="prefill"):
        Method("dense", prefill="topk", prefill_budget=0.25)
    with pytest.raises(ValueError, match="fraction"):
        Method("dense", prefill="uniform", prefill_budget=4)


def test_prefill_methods_run_at_equal_block_counts(tiny_llama_path):
    cfg = EvalConfig(base={"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32"}},
                     tasks=("niah_single",), lengths=(300, 500), samples_per_task=1, algorithms=("dense",), budgets=(),
                     prefill_modes=("uniform", "threshold", "hplb"), prefill_budget=0.25, prefill_block_size=16,
                     max_tokens=4)
    uniform = spin_config(cfg, tiny_llama_path, cfg.methods()[1], 500)
    block = uniform.sparse.prefill.typed_options()
    assert uniform.sparse.prefill.algorithm == "block" and block.budgets == "uniform" and block.block_size == 16
    results = evaluate(cfg, progress=False)
    density = results.prefill_density
    assert sorted(density) == [f"dense + prefill {m} 1/4@{n}" for m in ("hplb", "threshold", "uniform")
                               for n in (300, 500)]
    # Calibrated per length on another prompt: at each length the three compute about as many
    # blocks (and far fewer than all).
    for n in (300, 500):
        at_n = [v for k, v in density.items() if k.endswith(f"@{n}")]
        assert max(at_n) < 0.7 and max(at_n) - min(at_n) < 0.1, density
    assert "prefill_density" in results.to_dict()
