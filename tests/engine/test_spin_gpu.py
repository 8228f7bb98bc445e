"""The Spin decode path on CUDA: no host synchronisation inside a layer, and the same
tokens as the GPU-only cache when every page is selected."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kvcache.buffer_policy import BufferPolicy

pytestmark = pytest.mark.gpu
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Primes: 2, 3, 5,"]


def _engine(path, graphs=True, policy=BufferPolicy(), **cache_sparse):
    cache = {"page_size": 16, **cache_sparse.get("cache", {})}
    cfg = {"model": {"path": path, "device": "cuda", "dtype": "float32", "max_model_len": 512, "cuda_graphs": graphs},
           "cache": cache, "sparse": cache_sparse.get("sparse", {})}
    return Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=policy)


def test_decode_layers_never_synchronise_with_the_host(smollm2_path):
    # Pages of 4 tokens and shares of 12 pages per head, every page's home on the host (GPU
    # home pages are read in place, never looked up): 60 new tokens outgrow the share, so the
    # checked layers evict.
    # Eager steps (no CUDA graphs): every layer's forward runs here, checked.
    eng = _engine(smollm2_path, graphs=False, cache={"kind": "offloaded", "page_size": 4, "gpu_home_fraction": 0.0},
                  policy=BufferPolicy(pages_per_head=12),
                  sparse={"algorithm": "streaming", "budget": 32, "sink_tokens": 4, "local_tokens": 8})
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    for p in PROMPTS:
        eng.add_request(p, params)
    eng.step()  # prefill
    attention = eng.runner.attention
    plain = attention.forward
    calls = []

    def checked(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return plain(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            calls.append(1)

    attention.forward = checked
    runner_execute, executed = eng.runner.execute, []

    def counted(*args, **kwargs):
        executed.append(1)
        return runner_execute(*args, **kwargs)

    # A pipelined (async) decode call launches the next step before it reads this one's
    # tokens, so the model may run once more than step() is called: count the runs.
    eng.runner.execute = counted
    for _ in range(60):  # decode steps, with page turnover and evictions
        eng.step()
    eng.runner.execute = runner_execute
    assert len(executed) >= 60 and len(calls) == len(executed) * eng.model.config.num_layers
    assert eng.kv.buffer.counters[3].item() > 0  # evictions happened inside the checked layers
    attention.forward = plain
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()


def test_dense_offloaded_on_cuda_equals_gpu_only(smollm2_path):
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    a = [o.token_ids for o in _engine(smollm2_path).generate(PROMPTS, params)]
    eng = _engine(smollm2_path, cache={"kind": "offloaded"})
    b = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert a == b
    eng.check_integrity()
