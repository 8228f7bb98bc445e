"""The needle diagnosis: needle tokens found in the prompt, the oracle Select ranking the
needle page exactly as the true mass does, and clear errors for bad input."""

import pytest
import torch

from spin_cluster.config import SparseConfig
from spin_cluster.models import load_model
from spin_cluster.profiling import diagnose, ruler
from spin_cluster.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    tok = Tokenizer(tiny_llama_path)
    sample = ruler.make_sample("passkey", tok, 400, seed=5)
    model = load_model(tiny_llama_path, dtype=torch.float32, device="cpu", progress=False).eval()
    answer = ruler.plain_ids(tok, " " + sample.answers[0])
    return tok, sample, diagnose.capture(model, sample.prompt_ids, answer)


def test_needle_tokens_spell_the_key_at_each_occurrence(tiny):
    tok, sample, _ = tiny
    pos = diagnose.needle_token_positions(tok, sample.prompt_ids, sample.answers[0])
    runs = [[pos[0]]]
    for p in pos[1:]:
        runs[-1].append(p) if p == runs[-1][-1] + 1 else runs.append([p])
    assert len(runs) == 2  # "The pass key is K. Remember it. K is the pass key."
    for run in runs:
        assert sample.answers[0] in tok.decode([sample.prompt_ids[i] for i in run])
    with pytest.raises(ValueError, match="not in the prompt"):
        diagnose.needle_token_positions(tok, sample.prompt_ids, "no such needle")


def test_the_oracle_select_ranks_the_needle_as_the_true_mass_does(tiny):
    tok, sample, cap = tiny
    needle = diagnose.needle_token_positions(tok, sample.prompt_ids, sample.answers[0])
    specs = [diagnose.SelectSpec.parse("oracle"), diagnose.SelectSpec.parse("quest:score_block_tokens=4")]
    sparse = SparseConfig(algorithm="quest", budget=64, sink_tokens=16, local_tokens=32)
    diag = diagnose.diagnose(cap, specs, needle, sparse, page_size=16)
    L, Hkv = cap.k.shape[0], cap.k.shape[2]
    assert len(diag.rows) == len(cap.step_positions) * L * Hkv
    assert diag.budget_pages == 4
    for row in diag.rows:
        assert row.rank["oracle"] == row.oracle_rank
        assert row.recall["oracle"] >= row.recall["quest:score_block_tokens=4"] - 1e-5  # no Select beats it
    text = diagnose.report(diag, threshold=0.0)
    assert "| oracle |" in text and "quest:score_block_tokens=4" in text


@pytest.mark.parametrize("bad, words", [
    ("quest:score_block_tokens", "KEY=VALUE"),
    ("no_such_select", "unknown sparse algorithm"),
])
def test_bad_selects_say_what_to_change(bad, words):
    with pytest.raises(ValueError, match=words):
        diagnose.SelectSpec.parse(bad)


def test_the_command_refuses_a_task_with_many_answers(tiny_llama_path, capsys):
    code = diagnose.main(["--model", tiny_llama_path, "--task", "niah_multivalue", "--length", "400"])
    assert code == 2 and "one-answer task" in capsys.readouterr().err
