"""Logprobs on the default model against transformers' own log-softmax (float32, CPU): the
sampled tokens' and the prompt's, whole or in chunks, untouched by sampling processors."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOP = 20


def _engine(path, **scheduler):
    cfg = {"model": {"path": path, "device": "cpu", "dtype": "float32"}, "scheduler": scheduler}
    return Engine(SpinConfig.from_dict(cfg), progress=False)


def _check(found, ref_rows, token_ids, k):
    """found[i] is the logprobs of token_ids[i] under ref_rows[i]."""
    assert [f.token_id for f in found] == token_ids
    for f, row, tok in zip(found, ref_rows, token_ids):
        assert abs(f.logprob - row[tok].item()) < 1e-3
        values, ids = row.topk(k)
        assert len(f.top) == k
        assert torch.allclose(torch.tensor([v for _, v in f.top]), values, atol=1e-3)
        # ids equal where the values are not near-ties
        assert [i for i, _ in f.top][:3] == ids.tolist()[:3]


# the prompt in one step, or in chunks of 8 tokens; its logits 256 rows at a time, or 3
@pytest.mark.parametrize("chunk, rows", [(1024, 256), (8, 256), (1024, 3)])
def test_sampled_and_prompt_logprobs_equal_transformers(smollm2_path, hf_logprobs, monkeypatch, chunk, rows):
    monkeypatch.setattr("spin_cluster.engine.outputs.PROMPT_LOGITS_ROWS", rows)
    engine = _engine(smollm2_path, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=TOP, prompt_logprobs=5)
    out = engine.generate([PROMPT], params)[0]
    ref = hf_logprobs(out.prompt_token_ids + out.token_ids)
    n = len(out.prompt_token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 6
    _check(out.logprobs, ref[n - 1 : -1], out.token_ids, TOP)
    assert len(out.prompt_logprobs) == n - 1  # the first token has none
    _check(out.prompt_logprobs, ref[: n - 1], out.prompt_token_ids[1:], 5)


def test_logprobs_are_the_models_before_logit_bias_and_temperature(smollm2_path, hf_logprobs):
    engine = _engine(smollm2_path)
    forced = engine.tokenizer.encode(" banana")[-1]
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=3, logprobs=2, logit_bias={forced: 100})
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids == [forced] * 3
    ref = hf_logprobs(out.prompt_token_ids + out.token_ids)
    n = len(out.prompt_token_ids)
    # the chosen token's raw logprob: far from the top, which the bias did not move
    _check(out.logprobs, ref[n - 1 : -1], out.token_ids, 2)
    assert all(lp.logprob < lp.top[0][1] - 5 for lp in out.logprobs)


def test_no_logprobs_unless_asked(smollm2_path):
    out = _engine(smollm2_path).generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.logprobs == [] and out.prompt_logprobs is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_logprob_counts_past_twenty_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value}: must be in \[0, 20\]"):
        SamplingParams(**{field: value})
