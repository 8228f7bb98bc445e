"""The tests' tiny Llama re-shaped so that a placement can interleave heads across ranks."""

import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def four_kv_head_llama(tmp_path_factory, tiny_llama_path):
    """3 layers of 8 query heads over 4 KV heads (head dim 8), q/k/v/o biases; random
    weights, the tiny Llama's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = Path(tiny_llama_path)
    cfg = LlamaConfig.from_pretrained(src)
    cfg.update({"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 8, "attention_bias": True, "max_position_embeddings": 256})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # zero-initialised: make them matter, o_proj's included
                p.normal_(0.0, 0.3)
            elif p.dim() > 1:  # sharper logits than the default init: fewer near-ties
                p.mul_(8.0)
    out = tmp_path_factory.mktemp("llama-4kv")
    model.save_pretrained(out)
    for f in src.iterdir():  # tokenizer and chat template
        if f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return str(out)
