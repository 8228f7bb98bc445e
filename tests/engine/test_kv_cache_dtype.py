"""``cache.kv_cache_dtype``: which pages the paged cache holds on which device, and what a
float16 page changes (the bytes, not the tokens)."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.cache_builder import paged_kv_dtype
from spin_cluster.kernels import cpu_native

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def _pages(choice, dtype, device):
    return paged_kv_dtype(SpinConfig.from_dict({"cache": {"kv_cache_dtype": choice}}), dtype, device)


def test_null_picks_float16_pages_only_for_a_float32_model_on_a_cpu_that_reads_them():
    assert _pages(None, torch.float32, CPU) == (torch.float16 if cpu_native.kv_float16() else torch.float32)
    assert _pages(None, torch.bfloat16, CPU) == torch.bfloat16
    assert _pages(None, torch.bfloat16, GPU) == torch.bfloat16  # no CUDA needed: nothing is allocated


def test_auto_is_the_models_dtype_and_is_the_engines_default():
    assert SpinConfig().cache.kv_cache_dtype == "auto"
    for dtype, device in ((torch.float32, CPU), (torch.bfloat16, GPU)):
        assert _pages("auto", dtype, device) == dtype


def test_a_named_type_is_taken_on_the_cpu_and_refused_on_a_gpu_unless_it_is_the_models():
    assert _pages("float16", torch.float32, CPU) == torch.float16
    assert _pages("float32", torch.bfloat16, CPU) == torch.float32
    assert _pages("float16", torch.float16, GPU) == torch.float16
    with pytest.raises(ValueError, match="on a GPU the pages take the model's dtype"):
        _pages("float16", torch.bfloat16, GPU)


def test_float16_pages_hold_twice_the_tokens_in_the_same_memory(tiny_llama_path):
    from spin_cluster.engine import Engine

    def engine(choice):
        cfg = {"model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32"},
               "cache": {"kv_cache_gib": 0.004, "kv_cache_dtype": choice}}
        return Engine(SpinConfig.from_dict(cfg), progress=False)

    full, half = engine("float32"), engine("float16")
    assert half.kv.pool.k_pages.dtype == torch.float16
    assert half.kv.num_total_pages == pytest.approx(2 * full.kv.num_total_pages, abs=2)
