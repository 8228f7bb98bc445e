"""Shared fixtures: the default model, a tiny random Llama, a tiny random Gemma 3, and the gpu marker."""

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
def hf_logprobs(smollm2_path):
    """token ids -> [T, V] float32 log_softmax of transformers' SmolLM2 logits at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    def run(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    run.model = model
    return run


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


class TinyGemma3:
    """Tiny random-weight Gemma 3 checkpoints (window 16 unless told) with SmolLM2's tokenizer."""

    WINDOW = 16
    LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")

    def __init__(self, tmp_path_factory, smollm2_path: str) -> None:
        self._tmp = tmp_path_factory
        self._tokenizer = smollm2_path

    def config(self, max_position_embeddings: int = 512, layer_types=LAYER_TYPES, window: int = WINDOW):
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_position_embeddings,
            sliding_window=window, layer_types=list(layer_types), rope_theta=1e6, rope_local_base_freq=1e4,
            # 24 != head_dim: the query scale is not the backend's D ** -0.5
            query_pre_attn_scalar=24, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=True,
        )

    def save(self, config, name: str = "tiny-gemma3") -> str:
        """Random weights at toy size (norm weights away from 0, sharp logits); the engine is
        fed token ids, so the tokenizer only has to load (its chat template serves the
        evaluation's prompts). Returns the checkpoint's folder."""
        from transformers import Gemma3ForCausalLM

        out = self._tmp.mktemp(name)
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(0.3 * torch.randn_like(p))  # Gemma scales by 1 + weight
                else:
                    p.mul_(4.0)
        model.config.architectures = ["Gemma3ForCausalLM"]
        model.save_pretrained(out)
        for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.exists(f"{self._tokenizer}/{fname}"):
                shutil.copy(f"{self._tokenizer}/{fname}", out / fname)
        return str(out)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, smollm2_path) -> TinyGemma3:
    return TinyGemma3(tmp_path_factory, smollm2_path)


@pytest.fixture(scope="session")
def tiny_gemma3_path(tiny_gemma3) -> str:
    """Four layers, the third full attention, the others a window of 16 tokens; 512 positions."""
    return tiny_gemma3.save(tiny_gemma3.config())
