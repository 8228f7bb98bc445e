"""Fixtures of the model tests: a contiguous one-sequence attention backend, tiny random-weight
checkpoints written by transformers' own ``save_pretrained``, and stepping the transformers
reference model with its own KV cache.

Helpers reach the tests as fixtures only (no test imports this file), so the layout works
whichever way pytest names the test modules."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

VOCAB = 192
HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 3
HEADS = 4
KV_HEADS = 2


class ContiguousAttention:
    """LayerAttention for ONE sequence: keeps each layer's K/V concatenated and attends
    causally over everything stored; this step's T queries are the last T positions."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}  # layer -> [L, Hkv, D]
        self.v: dict[int, torch.Tensor] = {}

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]
        if layer_id in self.k:
            k = torch.cat([self.k[layer_id], k])  # [L, Hkv, D]
            v = torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v
        t, h, _ = q.shape
        length, hkv, _ = k.shape
        # Query i sits at position length - t + i and sees keys 0 ..= that position.
        mask = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)  # [T, L]
        k = k.repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v.repeat_interleave(h // hkv, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )  # [H, T, D]
        return o.transpose(0, 1)  # [T, H, D]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return base


def _hf_config(kind: str):
    import transformers as tf

    if kind == "llama3_sharded":
        # transformers 5 turns `rope_scaling` into `rope_parameters` (and 4 keeps it as is).
        return tf.LlamaConfig(**_common(rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False))
    if kind == "llama_tied":
        return tf.LlamaConfig(**_common(rope_theta=500000.0, tie_word_embeddings=True))
    if kind == "qwen2":
        return tf.Qwen2Config(
            **_common(rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=[2, 3])
        )
    if kind == "qwen2_yarn":
        # Qwen2.5's long-context setting (its model card's config.json addition) over a 64-token
        # original context: the engine tests run it past 64.
        return tf.Qwen2Config(**_common(
            rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=64,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    if kind == "qwen3":
        # head_dim 32 != hidden / heads (16): the explicit head_dim must be honoured.
        return tf.Qwen3Config(
            **_common(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
        )
    raise KeyError(kind)


def build_checkpoint(kind: str, out: Path) -> Path:
    """Random-weight checkpoint of one of the tiny models, saved by transformers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_hf_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0; make both matter.
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    kw = {"max_shard_size": "40KB"} if kind == "llama3_sharded" else {}
    model.save_pretrained(out, **kw)
    return out


CHECKPOINT_KINDS = ("llama3_sharded", "llama_tied", "qwen2", "qwen2_yarn", "qwen3")


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


def hf_step(model, input_ids: torch.Tensor, cache):
    """One forward of the transformers model on [1, T] ids with its own KV cache.
    Returns (logits [T, V] float32, cache). The cache keyword was renamed in transformers 5."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True, **{key: cache})
    return out.logits[0].float(), getattr(out, key)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """kind -> folder of a tiny random-weight checkpoint, for every kind in CHECKPOINT_KINDS."""
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: build_checkpoint(kind, root / kind) for kind in CHECKPOINT_KINDS}


@pytest.fixture(params=CHECKPOINT_KINDS)
def any_checkpoint(request, checkpoints) -> tuple[str, Path]:
    """(kind, folder), once per checkpoint kind."""
    return request.param, checkpoints[request.param]


@pytest.fixture
def contiguous_attention():
    """The ContiguousAttention class; each instance is a fresh, empty one-sequence cache."""
    return ContiguousAttention


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Exactly ``max_new`` greedy tokens of the transformers model after ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new)
    return out[0, len(prompt):].tolist()


class _Reference:
    load = staticmethod(hf_model)
    step = staticmethod(hf_step)
    greedy = staticmethod(hf_greedy)


@pytest.fixture
def hf_reference():
    """``.load(path, dtype=float32)`` a transformers model; ``.step(model, ids [1, T], cache)``
    -> (logits [T, V] float32, cache); ``.greedy(model, prompt ids, n)`` -> n greedy token ids."""
    return _Reference
