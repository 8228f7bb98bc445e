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

# Qwen/Qwen2.5-Coder-1.5B-Instruct's config.json: the Qwen2.5 fields above at its sizes, 28
# layers, 12 query and 2 KV heads of D 128, tied embeddings, a 32K context (the real model the
# accuracy runs serve, here with random weights for its memory plan).
QWEN25_CODER_15B = {
    **QWEN25_32B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}

# google/gemma-3-27b's text config (the fields the engine reads): 62 layers, every sixth one
# full attention and the others a 1024-token sliding window, 32 query and 16 KV heads of D 128,
# about 54 GB of bf16 weights (a 262K vocabulary, tied). Its full-attention RoPE is scaled
# linearly by 8 for 128K; the shape gives the positions without the scaling (random weights:
# only the sizes matter). bos/eos as in LLAMA_31_8B.
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}

# The benchmarks' --shape choices.
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "qwen2.5-32b": QWEN25_32B, "gemma-3-27b": GEMMA3_27B}


def tiny(shape: dict, fields: dict) -> dict:
    """``shape`` with toy sizes ``fields``; a model with layer types keeps its pattern over the
    first ``fields['num_hidden_layers']`` layers, at least one of them full attention."""
    out = {**shape, **fields}
    types = shape.get("layer_types")
    if types:
        n = max(fields["num_hidden_layers"], types.index("full_attention") + 1)
        out.update(num_hidden_layers=n, layer_types=types[:n], sliding_window=min(shape["sliding_window"], 32))
    return out


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
