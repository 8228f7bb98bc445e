"""The engine on the real default model, against transformers' own generate."""

import subprocess
import sys

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)


def _engine(path, *, admission_output_tokens=ADMISSION_OUTPUT_TOKENS, **sections):
    cfg = {"model": {"path": path, "device": "cpu", "dtype": "float32"}, **sections}
    return Engine(SpinConfig.from_dict(cfg), progress=False, admission_output_tokens=admission_output_tokens)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return _engine(smollm2_path)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(scope="module")
def served_pages_engine(smollm2_path):
    """The bundled serving config's cache pages (``kv_cache_dtype: null``): float16 on a CPU
    whose decode kernel reads them."""
    return _engine(smollm2_path, cache={"kv_cache_dtype": None})


@pytest.mark.parametrize("pages", ["auto", "served"])
def test_greedy_matches_transformers_generate_token_for_token(engine, served_pages_engine, hf_greedy, pages):
    from spin_cluster.kernels import cpu_native

    if pages == "served":
        engine = served_pages_engine
        want = torch.float16 if cpu_native.kv_float16() else torch.float32
        assert engine.kv.pool.k_pages.dtype == want
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy[prompt], prompt
        assert out.finish_reason == "length"
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _batch_prompts():
    base = "In the beginning there was a word, and the word was spoken again and again. "
    return [base * k + f"Item {k}:" for k in (1, 2, 3, 5, 8, 11, 14, 17)]


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [True, False])
def test_batch_invariance(smollm2_path, chunked):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sched = {"max_num_batched_tokens": 64 if chunked else 512, "enable_chunked_prefill": chunked}
    eng = _engine(smollm2_path, scheduler=sched, model={"path": smollm2_path, "device": "cpu", "dtype": "float32", "max_model_len": 512})
    prompts = _batch_prompts()
    assert max(len(eng.tokenizer.encode(p)) for p in prompts) > 200  # several chunks each
    together = [o.token_ids for o in eng.generate(prompts, params)]
    alone = [eng.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    eng.check_integrity()


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(smollm2_path, engine):
    params = SamplingParams(temperature=0, max_tokens=56, ignore_eos=True)
    prompts = [f"Story number {i}: the dragon" for i in range(4)]
    small = _engine(smollm2_path, cache={"kv_cache_gib": 0.008}, admission_output_tokens=0)
    # 11 logical pages of 16 tokens; four requests of ~64 tokens need 16.
    assert small.kv.num_total_pages < 4 * small.kv.pages_for_tokens(64)
    outs = small.generate(prompts, params)
    assert small.num_preemptions_total > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(prompts, params)]
    small.check_integrity()
    assert small.kv.num_free_pages == small.kv.num_total_pages


def test_stop_string_is_cut_from_the_text(engine):
    full = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    word = full.text.split()[1]
    out = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, stop=(word,)))[0]
    assert out.finish_reason == "stop"
    assert word not in out.text and full.text.startswith(out.text)


def test_stop_token_id_and_length(engine):
    full = engine.generate(["def add(a, b):"], GREEDY)[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = engine.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    short = engine.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_stream_yields_the_same_tokens_as_generate(engine):
    chunks = list(engine.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10)))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.new_token_ids] == chunks[-1].token_ids
    assert "".join(c.new_text for c in chunks) == chunks[-1].text
    assert chunks[-1].token_ids == engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10))[0].token_ids


def test_seeded_sampling_repeats_and_differs_across_seeds(engine):
    p = lambda s: SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
    a = engine.generate([PROMPTS[2]], p(1))[0].token_ids
    b = engine.generate([PROMPTS[2], PROMPTS[1]], [p(1), p(2)])[0].token_ids
    c = engine.generate([PROMPTS[2]], p(3))[0].token_ids
    assert a == b and a != c


def test_abort_mid_generation_frees_every_page(engine):
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50))
    other = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_pages < engine.kv.num_total_pages
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort(rid) is None
    engine.check_integrity()
    engine.abort(other)
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages and not engine.has_unfinished()


def test_closing_a_stream_early_aborts_it(engine):
    it = engine.stream(PROMPTS[3], SamplingParams(temperature=0, max_tokens=50))
    next(it)
    it.close()
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_prompt_longer_than_the_context_is_refused(engine):
    with pytest.raises(ValueError, match="context is 8192 tokens"):
        engine.add_request(list(range(100, 100 + 8192)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 10**7])
    engine.check_integrity()


def test_chat_template_is_applied(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out.text


def test_cli_generate_names_paris(smollm2_path):
    res = subprocess.run(
        [sys.executable, "-m", "spin_cluster.cli", "generate", "--max-tokens", "12", "--model", smollm2_path,
         "The capital of France is"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_cli_rejects_bad_sampling_values_before_loading():
    res = subprocess.run(
        [sys.executable, "-m", "spin_cluster.cli", "generate", "--temperature", "-1", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2 and "temperature" in res.stderr
