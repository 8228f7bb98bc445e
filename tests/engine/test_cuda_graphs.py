"""Decode CUDA graphs (``model.cuda_graphs``): padded batch sizes, and the same tokens as
eager decode on the GPU; the chunk mask the GPU path hands to SDPA."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.cuda_graphs import cuda_graph_batch_sizes
from spin_cluster.dense_attention import chunk_causal_mask


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(6) == [1, 2, 4, 6]
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_lower_right_causal_bias_is_the_chunk_mask():
    """What CUDA gets (a CausalBias) attends exactly as what the CPU gets (a boolean mask)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for n in (5, 12, 12))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_causal_mask(5, 7, q.device))
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 12))
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_graph_decode_gives_the_eager_tokens(tiny_llama_path):
    def run(graphs):
        cfg = SpinConfig.from_dict({
            "model": {"path": tiny_llama_path, "device": "cuda", "dtype": "float32", "max_model_len": 256,
                      "cuda_graphs": graphs},
            "cache": {"page_size": 16, "kv_cache_gib": 0.05},
            "scheduler": {"max_num_seqs": 6, "max_num_batched_tokens": 128},
        })
        engine = Engine(cfg, progress=False)
        assert (engine.runner.graphs is not None) == graphs
        # 5 requests (padded to 6), finishing at different steps (batches 5 .. 1, padded).
        prompts = [[100 + 7 * i + j for j in range(20 + 9 * i)] for i in range(5)]
        params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(5)]
        outs = engine.generate(prompts, params)
        engine.check_integrity()
        return [o.token_ids for o in outs]

    assert run(True) == run(False)
