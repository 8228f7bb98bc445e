import pytest
import torch

from spin_cluster.engine.request import SamplingParams
from spin_cluster.engine.sampler import Sampler, filtered_probs, weigh


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_params_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)


def test_top_k_keeps_exactly_k_tokens():
    row = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = filtered_probs(row, SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (filtered_probs(row, SamplingParams(top_p=0.75)) > 0).tolist() == [True, True, False, False]
    assert (filtered_probs(row, SamplingParams(top_p=0.8)) > 0).tolist() == [True, True, False, False]
    assert (filtered_probs(row, SamplingParams(top_p=0.81)) > 0).tolist() == [True, True, True, False]
    # The top token always survives, however small p is.
    assert (filtered_probs(row, SamplingParams(top_p=0.01)) > 0).tolist() == [True, False, False, False]


def test_seeded_requests_repeat_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    # The sampler weighs its rows in place: each call gets its own copy.
    alone = [Sampler(torch.device("cpu")).sample(logits[:1].clone(), ["a"], [p])[0] for _ in range(2)]
    s = Sampler(torch.device("cpu"))
    other = SamplingParams(temperature=1.0)
    batched = s.sample(logits.clone(), ["x", "a", "y"], [other, p, other])
    shifted = torch.stack([logits[1], logits[0], logits[2]])
    assert alone[0] == alone[1]
    assert batched[1] == Sampler(torch.device("cpu")).sample(shifted[:1].clone(), ["a"], [p])[0]


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05, 0.0]),
    # probabilities to the power 1/0.7, then the smallest set reaching 0.9 (three tokens)
    (SamplingParams(temperature=0.7, top_p=0.9), [0.6018, 0.2903, 0.1079, 0.0, 0.0]),
    # probabilities to the power 1/1.3 over the top three
    (SamplingParams(temperature=1.3, top_k=3), [0.4827, 0.3262, 0.1911, 0.0, 0.0]),
])
def test_draws_follow_the_filtered_distribution(params, expected):
    s = Sampler(torch.device("cpu"), seed=3)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])).repeat(500, 1)
    counts = torch.zeros(5)
    for _ in range(8):  # 4,000 draws, 500 rows a batch
        for t in s.sample(logits.clone(), [f"r{i}" for i in range(500)], [params] * 500):
            counts[t] += 1
    freq = counts / counts.sum()
    assert freq[4] == 0 and (freq[torch.tensor(expected) == 0] == 0).all()  # weight 0: never drawn
    assert torch.allclose(freq, torch.tensor(expected), atol=0.03)


def test_greedy_and_sampled_rows_share_a_batch():
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0], [9.0, 0.0, 1.0]])
    logits[1, 2] = 50.0  # a sampled row whose mass is all on token 2
    greedy = SamplingParams(temperature=0)
    assert s.sample(logits, ["a", "b", "c"], [greedy, SamplingParams(temperature=1.0), greedy]) == [1, 2, 0]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    s = Sampler(torch.device("cpu"))
    assert s.sample(logits, ["a", "b"], [SamplingParams(temperature=0)] * 2) == [1, 0]


def test_logit_bias_is_added_to_its_own_rows_only():
    logits = torch.tensor([[3.0, 1.0, 0.0, 2.0], [3.0, 1.0, 0.0, 2.0], [3.0, 1.0, 0.0, 2.0]])
    params = [SamplingParams(temperature=0, logit_bias={2: 10}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={0: -100, 1: 1.5})]
    assert Sampler(torch.device("cpu")).sample(logits, ["a", "b", "c"], params) == [2, 0, 1]
    assert logits[2].tolist() == [-97.0, 2.5, 0.0, 2.0]


@pytest.mark.parametrize("bias, match", [({-1: 1}, "must be >= 0"), ({3: 100.5}, r"\[-100, 100\]")])
def test_bad_logit_bias_raises(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_raises():
    with pytest.raises(ValueError, match=r"logit_bias=\{50000: \.\.\.\}: token id 50000 is outside"):
        SamplingParams(logit_bias={50000: 1, 3: 1}).check_vocab(49152)


def test_weights_of_a_mixed_batch_are_each_rows_distribution():
    """Rows with top-k/top-p beside temperature-only rows: each row's weights are its own
    distribution up to a constant, as when it is weighed alone."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_p=0.8)]
    mixed = logits.clone()
    weigh(mixed, params)
    for i, p in enumerate(params):
        alone = logits[i:i + 1].clone()
        weigh(alone, [p])
        assert torch.allclose(mixed[i] / mixed[i].sum(), alone[0] / alone[0].sum(), atol=1e-6), i
    assert (mixed[1] > 0).sum() == 5  # top-k kept its five
    assert torch.allclose(mixed[0] / mixed[0].sum(), torch.softmax(logits[0] / 0.7, -1), atol=1e-6)
