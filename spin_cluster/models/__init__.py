"""Model definitions and checkpoint loading (Llama, Qwen2, Qwen3, Gemma 3 text from HF safetensors)."""

from spin_cluster.models.base import LayerAttention
from spin_cluster.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spin_cluster.models.gemma3 import Gemma3CausalLM
from spin_cluster.models.llama import CausalLM
from spin_cluster.models.loader import SUPPORTED_DTYPES, load_model, random_model, resolve_dtype

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_DTYPES",
    "LayerAttention",
    "CausalLM",
    "Gemma3CausalLM",
    "ModelConfig",
    "load_model",
    "random_model",
    "resolve_dtype",
]
