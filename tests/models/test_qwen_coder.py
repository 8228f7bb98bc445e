"""Qwen2.5-Coder-Instruct and YaRN in the engine against transformers (float32, CPU, greedy).

* A tiny random-weight Qwen2 with a 64-token context: with YaRN (factor 4) turned on by
  ``model.hf_overrides``, the engine serves 256 tokens, and its greedy tokens on prompts past
  64 equal transformers' on the same checkpoint with the same rope_scaling in its config.json.
  Without the override the engine refuses the longer context, naming the setting.
* Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct from their GGUF part packages: greedy tokens
  on a chat prompt and on prose of ~100 and ~400 tokens, prefilled in chunks over pages.
  Skipped (with the pip line) where the extra is not installed; without it, preparing the
  model is one ValueError naming the extra.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

ORIGINAL = 64  # the tiny model's max_position_embeddings
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_path):
    """Random weights at toy size, a 64-token context, SmolLM2's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ORIGINAL,
                      rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{smollm2_path}/{name}", out / name)
    return out


def _engine(path, max_model_len: int | None, hf_overrides=None, page_size: int = 16,
            batched_tokens: int = 256) -> Engine:
    return Engine(SpinConfig.from_dict({
        "model": {"path": str(path), "device": "cpu", "dtype": "float32", "max_model_len": max_model_len,
                  "hf_overrides": hf_overrides},
        "cache": {"page_size": page_size, "kv_cache_dtype": "auto"},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": batched_tokens},
    }), progress=False)


def _first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def test_yarn_tokens_past_the_original_context_equal_transformers(tiny_qwen2, tmp_path, hf_reference):
    yarn_folder = tmp_path / "with-yarn"
    shutil.copytree(tiny_qwen2, yarn_folder)
    cfg = json.loads((yarn_folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (yarn_folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": YARN}))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (40, 100, 180)]
    max_new = 60  # the longest request ends at 240 of the 256 positions
    ref = hf_reference.load(yarn_folder)
    assert ref.model.rotary_emb.rope_type == "yarn"
    want = [hf_reference.greedy(ref, p, max_new) for p in prompts]
    engine = _engine(tiny_qwen2, None, {"rope_scaling": YARN}, page_size=8, batched_tokens=64)
    assert engine.max_model_len == 4 * ORIGINAL
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new,
                                                                        ignore_eos=True))]
    for g, w in zip(got, want):
        assert g == w, f"first difference at token {_first_difference(g, w)}"
    # Plain RoPE (no override) gives other tokens past 64: the test can tell them apart.
    plain = hf_reference.load(tiny_qwen2)
    assert hf_reference.greedy(plain, prompts[2], max_new) != want[2]


def test_a_context_past_the_model_without_yarn_names_the_setting(tiny_qwen2):
    with pytest.raises(ValueError, match="hf_overrides"):
        _engine(tiny_qwen2, 4 * ORIGINAL)


# ---- Qwen2.5-Coder-Instruct from its GGUF part packages -------------------------------------

_CHAT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
_PROSE = ("The build failed on the second stage because the cache key changed. "
          "We pinned the compiler, cleared the artifacts and ran the pipeline again. "
          "The linker still complained about a missing symbol in the math library. ")


def _prepared(name: str) -> str:
    from spin_cluster.model_store import SPLIT_GGUFS, prepare_model

    try:
        SPLIT_GGUFS[name].part_paths()
    except ValueError as e:
        pytest.skip(str(e))
    return str(prepare_model(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_coder_greedy_tokens_match_transformers(name, hf_reference):
    from transformers import AutoTokenizer

    path = _prepared(name)
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template(_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [list(chat), *(tok(_PROSE * (n // 40)).input_ids[:n] for n in (100, 400))]
    max_new = 24
    ref = hf_reference.load(path)
    want = [hf_reference.greedy(ref, p, max_new) for p in prompts]
    del ref
    engine = _engine(path, 1024, batched_tokens=256)
    assert (engine.model.config.num_kv_heads, engine.model.config.max_position_embeddings) == (2, 32768)
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new,
                                                                        ignore_eos=True))]
    for g, w in zip(got, want):
        assert g == w, f"first difference at token {_first_difference(g, w)}"
    assert "def" in tok.decode(got[0])  # the instruct model answers the chat prompt with code


@pytest.mark.parametrize("name, extra", [("qwen2.5-coder-1.5b", "qwen-coder-1-5b"),
                                         ("qwen2.5-coder-0.5b", "qwen-coder-0-5b")])
def test_prepare_without_the_extra_names_it(monkeypatch, tmp_path, name, extra):
    from spin_cluster import model_store

    monkeypatch.setenv("SPIN_MODEL_DIR", str(tmp_path))
    missing = model_store.SplitGguf(name, "no-such-part-package", 2, extra, "Apache-2.0")
    monkeypatch.setitem(model_store.SPLIT_GGUFS, name, missing)
    with pytest.raises(ValueError, match=rf"pip install spin-cluster\[{extra}\]"):
        model_store.prepare_model(name)
    assert not any(tmp_path.iterdir())  # nothing that looks prepared


def test_models_prepare_without_the_extra_is_one_error_line(tmp_path):
    """The CLI as a user runs it, in a Python whose site has no part packages."""
    code = ("import sys; from spin_cluster import model_store as m;"
            "m.SPLIT_GGUFS['qwen2.5-coder-1.5b'] = m.SplitGguf('qwen2.5-coder-1.5b', 'no-such-part', 2,"
            " 'qwen-coder-1-5b', 'Apache-2.0');"
            "from spin_cluster.cli import main; sys.argv = ['spin-cluster', 'models', 'prepare', 'qwen2.5-coder-1.5b'];"
            "sys.exit(main())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"SPIN_MODEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "spin-cluster[qwen-coder-1-5b]" in lines[0]
