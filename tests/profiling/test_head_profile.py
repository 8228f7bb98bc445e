import json
import math

import numpy as np
import pytest
import torch

from spin_cluster.hplb.budget import maxmin_budgets, total_tokens
from spin_cluster.hplb.profile import load_profile, save_profile
from spin_cluster.profiling.cli import main as profiling_main
from spin_cluster.profiling.head_profile import (
    FRACTIONS,
    MassRecorder,
    ProfileConfig,
    profile_model,
    spearman,
    stability,
    summary_markdown,
)


def _mass_at(curves, fraction):
    return curves[..., int(np.argmin(abs(FRACTIONS - fraction)))]


def test_recovered_mass_is_sink_and_local_plus_the_best_middle_pages():
    # One query (the last of 64 positions), 2 query heads sharing 1 KV head, pages of 8 tokens:
    # sink = page 0, local = page 7 (the tail); middle pages 1..6.
    T, D, S = 64, 4, 8
    k = torch.zeros(T, 1, D)
    q = torch.zeros(T, 2, D)
    logit = torch.zeros(2, T)
    logit[0, 8 * 3] = logit[1, 8 * 5] = 6.0  # one hot key per query head, in pages 3 and 5
    k[:, 0, 0] = logit[0]
    k[:, 0, 1] = logit[1]
    q[-1, 0, 0] = q[-1, 1, 1] = math.sqrt(D)  # q.k / sqrt(D) = the logit
    rec = MassRecorder(queries=1, page_size=S, sink_tokens=8, local_tokens=8)
    curves = rec.recovered_mass(q, k)[0, 0]  # [F]
    probs = torch.softmax(logit, -1)  # [2, T]
    page = probs.view(2, 8, S).sum(-1).mean(0)  # [8] mean over the group
    base = page[0] + page[7]
    assert curves[0].item() == pytest.approx(base.item(), abs=1e-6)
    # 1 middle page (1/64 .. 8/64 of the context): the heavier of pages 3, 5 (equal here)
    one = _mass_at(curves.numpy(), 8 / 64)
    assert one == pytest.approx((base + page[3]).item(), abs=1e-6)
    assert _mass_at(curves.numpy(), 16 / 64) == pytest.approx((base + page[3] + page[5]).item(), abs=1e-6)
    assert curves[-1].item() == pytest.approx(1.0, abs=1e-6)
    assert bool((curves[1:] >= curves[:-1] - 1e-7).all())


class _Reverse:
    """A Select that ranks pages backwards (page 0 best), to tell its ranking from the oracle's."""

    def on_append(self, layer, rows, positions, k):
        pass

    def score(self, layer, q, rows, num_pages):
        return -torch.arange(num_pages, dtype=torch.float32).expand(q.shape[0], 1, num_pages)


def test_levels_follow_the_serving_selects_ranking_not_the_oracles():
    # The setup above: the mass sits in middle pages 3 and 5. A Select that ranks middle pages
    # 1, 2, 3, ... first reaches page 3 at its third page; the oracle takes it first.
    T, D, S = 64, 4, 8
    k, q = torch.zeros(T, 1, D), torch.zeros(T, 2, D)
    k[8 * 3, 0, 0] = k[8 * 5, 0, 1] = 6.0
    q[-1, 0, 0] = q[-1, 1, 1] = math.sqrt(D)
    oracle = MassRecorder(queries=1, page_size=S, sink_tokens=8, local_tokens=8).recovered_mass(q, k)[0, 0]
    ranked = MassRecorder(queries=1, page_size=S, sink_tokens=8, local_tokens=8,
                          select=_Reverse()).recovered_mass(q, k)[0, 0]
    assert ranked[0].item() == pytest.approx(oracle[0].item())  # no middle page: the same sink + local
    two, three = _mass_at(ranked.numpy(), 16 / 64), _mass_at(ranked.numpy(), 24 / 64)
    assert two < _mass_at(oracle.numpy(), 16 / 64) - 0.5  # pages 1, 2 against pages 3, 5
    assert three > two + 0.4  # page 3 (one query head's key) at the third page
    assert bool((oracle >= ranked - 1e-6).all())  # no Select beats the oracle
    assert ranked[-1].item() == pytest.approx(1.0, abs=1e-6)


def test_answer_steps_end_each_task_prompt_with_its_answer(smollm2_path):
    from spin_cluster.profiling import ruler
    from spin_cluster.profiling.head_profile import calibration_prompts
    from spin_cluster.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    config = ProfileConfig(lengths=(600,), samples=1, families=("retrieval", "prose"), answer_steps=True)
    rows = list(calibration_prompts(config, tok))
    family, n, ids, queries = rows[0]  # niah_single, seed 1000
    sample = ruler.make_sample("niah_single", tok, 600, 1000)
    answer = ruler.plain_ids(tok, " " + sample.answers[0])
    assert family == "retrieval" and ids == list(sample.prompt_ids) + answer[:-1] and queries == len(answer)
    assert all(q == config.queries for f, _, _, q in rows if f == "prose")  # prose: its last positions


def test_a_select_that_scores_no_page_is_refused():
    with pytest.raises(ValueError, match="scores no page"):
        ProfileConfig(select="streaming")


def test_spearman_ranks_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([0, 0, 1, 2], [0, 0, 2, 1]) == pytest.approx(7 / 9)  # ranks .5 .5 2 3 vs .5 .5 3 2
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


@pytest.fixture(scope="module")
def profile(tiny_llama_path):
    config = ProfileConfig(model_path=tiny_llama_path, lengths=(256,), samples=1, queries=4,
                           families=("retrieval", "prose"), device="cpu", dtype="float32")
    return profile_model(config, progress=False)


def test_profile_of_a_tiny_model(profile):
    assert set(profile.families) == {"retrieval", "prose"}
    assert profile.families["retrieval"].num_prompts == 4 and profile.families["prose"].num_prompts == 4
    mass = profile.mass
    assert mass.shape == (2, 2, len(FRACTIONS))  # 2 layers x 2 KV heads
    assert np.all(np.diff(mass, axis=-1) >= -1e-9) and np.allclose(mass[..., -1], 1.0, atol=1e-5)
    needs = profile.needs(0.95)
    assert len(needs) == 2 and all(len(row) == 2 for row in needs)
    assert all(b % 16 == 0 and 0 <= b <= 256 for row in needs for b in row)
    assert all(a <= b for ra, rb in zip(profile.needs(0.5), profile.needs(0.99)) for a, b in zip(ra, rb))
    (pair, rho), = stability(profile, 0.9).items()
    assert pair == ("retrieval", "prose") and (math.isnan(rho) or -1 <= rho <= 1)
    assert "| retrieval | prose |" in summary_markdown(profile)


def test_profile_file_is_tied_to_its_model(profile, tmp_path, tiny_llama_path, smollm2_path):
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    back = load_profile(path, model_path=tiny_llama_path)
    assert np.allclose(back.mass, profile.mass, atol=1e-5) and back.context_tokens == (256,)
    with pytest.raises(ValueError, match=r"measured on 'tiny-llama.*differs in .*num_layers.*spin-cluster profile --model"):
        load_profile(path, model_path=smollm2_path)
    data = json.loads(path.read_text())
    data["version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format version 99"):
        load_profile(tmp_path / "v99.json")
    with pytest.raises(ValueError, match="not found"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a head profile"):
        load_profile(tmp_path / "other.json")


def test_profile_feeds_maxmin_budgets(profile):
    budgets = maxmin_budgets(profile, total_tokens=4 * 32, floor_tokens=16, context_tokens=256)
    assert total_tokens(budgets) == 128 and min(b for row in budgets for b in row) >= 16


def test_profile_command_writes_json_and_heatmap(tiny_llama_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["profile", "--model", tiny_llama_path, "--lengths", "128", "--samples", "1", "--queries", "2",
            "--families", "prose", "--device", "cpu", "--dtype", "float32", "--quiet"]
    assert profiling_main([*args, "--out", str(out)]) == 0
    assert load_profile(out, model_path=tiny_llama_path).families["prose"].num_prompts == 4
    assert profiling_main(["profile", "--input", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| prose | 4 |" in capsys.readouterr().out
    assert profiling_main(["profile", "--coverage", "2", "--input", str(out)]) == 2
