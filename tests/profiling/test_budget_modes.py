"""Budget modes of the accuracy comparison: uniform top-k, online top-p and S-HPLB max-min,
all at the same total."""

import numpy as np
import pytest

from spin_cluster.hplb.profile import FamilyCurves, HeadProfile, model_identity, save_profile
from spin_cluster.profiling.evaluate import EvalConfig, spin_config
from spin_cluster.profiling.methods import Method, make_methods


@pytest.fixture
def profile_path(smollm2_path, tmp_path):
    """A made-up profile of SmolLM2 (30 layers x 3 KV heads): head 0 of every layer dense,
    the others sparse."""
    x = np.linspace(0, 1, 33)
    mass = np.empty((30, 3, 33))
    mass[:, 0] = np.sqrt(x)
    mass[:, 1:] = np.minimum(1, 0.95 + x)
    profile = HeadProfile(model=model_identity(smollm2_path), page_size=16, sink_tokens=16, local_tokens=64,
                          queries_per_prompt=4, context_tokens=(2048,), fractions=x,
                          families={"all": FamilyCurves(1, mass)})
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    return str(path)


def test_methods_per_mode_and_labels():
    methods = make_methods(["streaming", "quest"], [0.0625], budget_modes=("uniform", "top_p", "maxmin"))
    assert [m.label for m in methods] == ["dense", "streaming 1/16", "quest 1/16", "quest 1/16 top-p",
                                          "quest 1/16 max-min"]
    assert [m.series for m in methods[2:]] == ["quest", "quest top-p", "quest max-min"]
    assert [m.depends_on_length() for m in methods[2:]] == [False, False, True]
    with pytest.raises(ValueError, match="budget mode 'top_p' needs an algorithm that scores pages"):
        Method("streaming", 0.0625, budget_mode="top_p")
    with pytest.raises(ValueError, match="choose one of uniform, top_p, maxmin"):
        Method("quest", 0.0625, budget_mode="topk")


def test_every_mode_has_the_uniform_total(smollm2_path, profile_path):
    cfg = EvalConfig(base={"model": {"path": smollm2_path}}, tasks=("niah_single",), lengths=(2048,),
                     algorithms=("quest",), budgets=(0.0625,), budget_modes=("uniform", "top_p", "maxmin"),
                     top_p=0.8, profile_path=profile_path, floor_fraction=0.25)
    by_mode = {m.budget_mode: spin_config(cfg, smollm2_path, m, 2048).sparse for m in cfg.methods()[1:]}
    assert by_mode["uniform"].budget == 0.0625 and by_mode["uniform"].top_p is None
    assert by_mode["top_p"].top_p == 0.8 and by_mode["top_p"].per_head_budgets is None
    budgets = by_mode["maxmin"].per_head_budgets
    flat = [b for row in budgets for b in row]
    assert len(budgets) == 30 and sum(flat) == 90 * 128  # 1/16 of 2048 for each of 90 heads
    assert min(flat) >= 32 and all(b % 16 == 0 for b in flat)  # floor: a quarter of 128
    assert all(row[0] > 128 > max(row[1:]) for row in budgets)  # pages moved to the dense heads


def test_maxmin_needs_a_profile_of_this_model(smollm2_path, tiny_llama_path, profile_path):
    with pytest.raises(ValueError, match="spin-cluster profile --out F"):
        EvalConfig(algorithms=("quest",), budget_modes=("maxmin",))
    cfg = EvalConfig(base={"model": {"path": tiny_llama_path}}, tasks=("niah_single",), lengths=(512,),
                     algorithms=("quest",), budgets=(0.0625,), budget_modes=("maxmin",), profile_path=profile_path)
    with pytest.raises(ValueError, match="measured on 'SmolLM2-135M-Instruct'"):
        spin_config(cfg, tiny_llama_path, cfg.methods()[1], 512)
    with pytest.raises(ValueError, match="top_p"):
        EvalConfig(top_p=0.0)
