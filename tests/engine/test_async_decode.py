"""Pipelined decode (``scheduler.async_decode``): the next decode step is launched before the
host reads this one's tokens. Run here on the CPU, where the launch is synchronous but every
path of the pipeline is taken: the same tokens, stops and page accounting as the plain loop."""

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams


def _engine(path, async_decode, offload=False, max_len=256):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": max_len},
        "cache": {"page_size": 4, "kind": "offloaded" if offload else "paged"},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "async_decode": async_decode},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False)


PROMPTS = ["The capital of France is", "def f(x):", "Once upon a time", "1, 2, 3,"]


def _generate(engine, params):
    outs = engine.generate(PROMPTS, params)
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.mark.parametrize("offload", [False, True])
def test_pipelined_decode_gives_the_plain_loops_tokens_and_frees_everything(tiny_llama_path, offload):
    plain, piped = _engine(tiny_llama_path, False, offload), _engine(tiny_llama_path, True, offload)
    # mixed lengths: requests end by length at different steps; one stops on a token id of
    # its own output (a token-id stop that only the host sees, a step late)
    free_run = plain.generate(PROMPTS[3:], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = free_run.token_ids[5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17)]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))
    want = _generate(plain, params)
    got = _generate(piped, params)
    assert got == want
    assert piped.num_pipelined_steps > 10 and plain.num_pipelined_steps == 0
    assert want[3][2] == "stop" and len(want[3][0]) <= 6


def test_pipelined_decode_honours_stop_strings_and_min_tokens(tiny_llama_path):
    plain, piped = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    text = plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=16, stop=(stop,), min_tokens=3)
    assert _generate(piped, params) == _generate(plain, params)


def test_an_abort_while_a_step_is_in_flight_frees_the_request(tiny_llama_path):
    engine = _engine(tiny_llama_path, True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(6):  # prefill, then pipelined decode steps
        engine.step()
    assert engine._inflight  # a decode step launched, not read yet
    assert engine.abort(ids[1]) is not None
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != ids[1]
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {ids[0], ids[2]} and all(len(o.token_ids) == 30 for o in finished.values())
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_a_request_arriving_mid_decode_is_admitted_and_matches_the_plain_loop(tiny_llama_path):
    def run(engine):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        first = engine.add_request(PROMPTS[0], params)
        outs = {}
        for i in range(40):
            if i == 4:
                engine.add_request(PROMPTS[1], params, request_id="late")
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not engine.has_unfinished():
                break
        return outs[first], outs["late"]

    assert run(_engine(tiny_llama_path, True)) == run(_engine(tiny_llama_path, False))


@pytest.mark.parametrize("offload", [False, True])
def test_sampled_requests_are_pipelined_and_give_the_plain_loops_tokens(tiny_llama_path, offload):
    """Temperature, top-k, top-p, logit_bias and seeds, beside a greedy row: sampled on the
    device at launch, the same tokens as the plain loop (seeded rows draw in step order)."""
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=((5, 3.0),)),
              SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=17, ignore_eos=True,
                             logit_bias=((11, -100.0), (12, 2.0)))]
    plain, piped = _engine(tiny_llama_path, False, offload), _engine(tiny_llama_path, True, offload)
    want = _generate(plain, params)
    assert _generate(piped, params) == want
    assert piped.num_pipelined_steps > 10
    assert len({tuple(w[0]) for w in want}) == 4


def test_grammar_and_min_tokens_rows_take_the_plain_loop(tiny_llama_path):
    engine = _engine(tiny_llama_path, True)
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.8, seed=1, max_tokens=6, min_tokens=6))
    assert engine.num_pipelined_steps == 0


def test_async_decode_config_is_checked():
    with pytest.raises(ValueError, match="async_decode"):
        SpinConfig.from_dict({"scheduler": {"async_decode": "yes"}})


@pytest.mark.gpu
def test_sampling_a_pipelined_step_never_waits_for_the_gpu(tiny_llama_path, monkeypatch):
    """Sampled rows (temperature, top-k, top-p, logit_bias, seeds, beside a greedy one) are
    sampled at launch without a host synchronisation, or the launch would wait for the step
    before it."""
    import torch

    from spin_cluster.engine.sampler import Sampler

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    inner, calls = Sampler.sample_tensor, []

    def strict(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls.append(1)

    monkeypatch.setattr(Sampler, "sample_tensor", strict)
    cfg = {"model": {"path": tiny_llama_path, "device": "cuda", "dtype": "float32", "max_model_len": 256},
           "cache": {"page_size": 4}, "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                                     "async_decode": True}}
    engine = Engine(SpinConfig.from_dict(cfg), progress=False)
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=((5, 3.0),)),
              SamplingParams(temperature=0.7, top_p=0.8, max_tokens=12, ignore_eos=True)]
    engine.generate(PROMPTS, params)
    assert engine.num_pipelined_steps > 5 and len(calls) >= engine.num_pipelined_steps


def test_pipelined_decode_under_page_pressure_preempts_and_gives_the_plain_loops_tokens(tiny_llama_path):
    """Rows that each fit alone in the free pages but not together: the batch's next decode is
    refused and the fresh step preempts (it once failed taking the pages: the rows were checked
    one by one, then all allocated)."""
    def run(async_decode):
        cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
               "cache": {"page_size": 4, "kv_cache_gib": 0.00008},
               "scheduler": {"max_num_seqs": 6, "max_num_batched_tokens": 64, "async_decode": async_decode}}
        engine = Engine(SpinConfig.from_dict(cfg), progress=False, admission_output_tokens=0)  # preemptions happen
        outs = engine.generate([p * 3 for p in PROMPTS + ["Hello there", "import numpy"]],
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.check_integrity()
        assert engine.kv.num_free_pages == engine.kv.num_total_pages
        return [o.token_ids for o in outs], engine

    want, plain = run(False)
    got, piped = run(True)
    assert got == want
    assert piped.num_preemptions_total == plain.num_preemptions_total > 0 and piped.num_pipelined_steps > 10
