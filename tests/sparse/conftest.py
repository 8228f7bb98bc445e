"""Shared by the sparse algorithms' tests: an op recorder that flags host syncs, one request
row of random keys for the index tests, and the SmolLM2 engine run that each algorithm at a
whole-context budget must reproduce."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams

PROMPTS = ["The capital of France is", "List of prime numbers: 2, 3, 5, 7,"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class OpLog(TorchDispatchMode):
    """Every aten op run inside; flags host syncs and data-dependent shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            name += "[bool mask]"
        self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def syncs(self):
        bad = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh", "[bool mask]")
        return [op for op in self.ops if any(b in op for b in bad)]


@pytest.fixture
def one_row():
    """``(*algorithms, T=13, seed=0) -> (k [T, 2, 8], q [1, 4, 8])``: T random keys appended to
    row 1 of layer 0 of each algorithm (2 KV heads of 8; pages of 4, 4, 4, 1 tokens at T=13),
    and a random query of 2 query heads per KV head."""

    def fill(*algorithms, T=13, seed=0):
        g = torch.Generator().manual_seed(seed)
        k = torch.randn(T, 2, 8, generator=g)
        for alg in algorithms:
            alg.on_append(0, torch.full((T,), 1), torch.arange(T), k)
        return k, torch.randn(1, 4, 8, generator=g)

    return fill


@pytest.fixture
def op_log():
    """``with op_log() as log: ...`` records the ops run inside."""
    return OpLog


def _engine(path, sparse):
    cfg = {
        "model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
        "cache": {"page_size": 4, "kind": "offloaded"},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
        "sparse": sparse,
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False)


def _run(engine):
    outs = engine.generate(PROMPTS, PARAMS)
    engine.check_integrity()
    return [o.token_ids for o in outs]


@pytest.fixture
def offloaded_tokens(smollm2_path):
    """``(sparse) -> (engine, greedy tokens)`` of SmolLM2 over the offloaded cache (page size 4),
    the engine's integrity checked after the run."""

    def run(sparse):
        engine = _engine(smollm2_path, sparse)
        return engine, _run(engine)

    return run


@pytest.fixture(scope="session")
def dense_tokens(smollm2_path):
    # Dense over the offloaded cache equals the GPU-only cache (tests/engine) and runs faster here.
    return _run(_engine(smollm2_path, {"algorithm": "dense"}))
