"""Shared fixtures: the default model, a tiny random Llama, and the gpu marker."""

import os
import shutil

import torch

# The Triton interpreter must be chosen before triton is first imported in this process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path():
    from spin_cluster.model_store import prepare_default_model

    return str(prepare_default_model())


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path):
    """Random weights at toy size with SmolLM2's tokenizer: fast engine mechanics tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = os.path.join(smollm2_path, name)
        if os.path.exists(src):
            shutil.copy(src, out / name)
    return str(out)
