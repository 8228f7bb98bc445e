"""A checkpoint's shapes without its weights, for measuring the system at a model's size:
a folder with the config.json and a tokenizer, loaded with ``model.load_format: dummy``
(``random_model``: random weights drawn on the device)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

# meta-llama/Llama-3.1-8B's config.json (the fields the engine reads).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}

# Qwen/Qwen2.5-32B's config.json (the fields the engine reads): 64 layers, 40 query and 8 KV
# heads of D 128, about 64 GB of bf16 weights. Its context is 128K with YaRN; the shape gives
# the positions without the scaling (random weights: only the sizes matter). bos/eos are the
# benchmarks' tokenizer's (SmolLM2's), as in LLAMA_31_8B, not Qwen's own.
QWEN25_32B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
    "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 152064, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2,
}

# The benchmarks' --shape choices.
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "qwen2.5-32b": QWEN25_32B}


def shape_folder(shape: dict, max_len: int, tokenizer: str | None = None, prefix: str = "shapes-") -> str:
    """A new temporary folder with ``shape`` as config.json (room for ``max_len`` positions) and
    the tokenizer files of folder ``tokenizer`` (default: the prepared default model's)."""
    if tokenizer is None:
        from spin_cluster.model_store import prepare_default_model

        tokenizer = str(prepare_default_model())
    folder = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**shape, "max_position_embeddings": max(shape["max_position_embeddings"], max_len)}, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tokenizer, name)):
            shutil.copy(os.path.join(tokenizer, name), folder)
    return folder
