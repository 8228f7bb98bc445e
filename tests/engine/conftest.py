"""Engines on the tiny random Llama for the Select tests."""

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine


@pytest.fixture
def offload_engine(tiny_llama_path):
    """``make(sparse, max_num_batched_tokens=64)``: an Engine on the offloaded cache in pages of
    4 tokens (float32, CPU, 128-token context, 2 requests at once) with the ``sparse`` section
    over 1 sink page (4 tokens) and 2 local pages (8 tokens)."""

    def make(sparse: dict, max_num_batched_tokens: int = 64) -> Engine:
        cfg = {
            "model": {"path": tiny_llama_path, "device": "cpu", "dtype": "float32", "max_model_len": 128},
            "cache": {"page_size": 4, "kind": "offloaded"},
            "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": max_num_batched_tokens},
            "sparse": {"sink_tokens": 4, "local_tokens": 8, **sparse},
        }
        return Engine(SpinConfig.from_dict(cfg), progress=False)

    return make
