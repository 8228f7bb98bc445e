"""Per-step torch threads on the CPU (``StepThreads``, the served default "auto"): prefill
chunks of at least ``min_tokens`` tokens run on the large count, decode steps on the small
one, and the tokens are those of an engine on a fixed count."""

import threading

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.step_threads import StepThreads
from spin_cluster.kernels import cpu_native
from spin_cluster.models import cpu_linear

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class _Recording(StepThreads):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.steps: list[tuple[int, int]] = []  # (tokens, threads torch ran the step on)

    def apply(self, num_tokens: int) -> int:
        threads = super().apply(num_tokens)
        self.steps.append((num_tokens, torch.get_num_threads()))
        return threads


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_native.set_row_threads(None)
    cpu_linear.set_row_blocks(None)


def _run(path, step_threads=None):
    cfg = {"model": {"path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256},
           "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64}}
    engine = Engine(SpinConfig.from_dict(cfg), progress=False)
    engine.runner.step_threads = step_threads
    prompts = [list(range(100, 140)), list(range(300, 310))]  # 40 and 10 tokens
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def test_prefill_steps_take_the_large_count_and_decode_steps_the_small(tiny_llama_path, keep_threads):
    torch.set_num_threads(1)
    expected = _run(tiny_llama_path)
    policy = _Recording(1, 2, 16)
    assert _run(tiny_llama_path, policy) == expected
    prefill, decode = policy.steps[0], policy.steps[-1]
    assert prefill == (50, 2)  # both prompts in the first step: 40 + 10 tokens
    assert decode == (2, 1)  # two decode rows
    assert all(threads == (2 if tokens >= 16 else 1) for tokens, threads in policy.steps)


def test_the_count_is_set_only_when_it_changes(monkeypatch):
    calls, rows = [], []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(cpu_native, "set_row_threads", rows.append)
    policy = StepThreads(1, 4, 128)
    assert [policy.apply(n) for n in (512, 300, 3, 1, 128, 127)] == [4, 4, 1, 1, 4, 1]
    assert calls == [4, 1, 4, 1]
    assert set(rows) == {4}  # decode attention's rows: the large count in every step


def test_prefill_steps_split_their_gemms_into_row_blocks_off_openmp(monkeypatch):
    calls, rows, blocks = [], [], []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(cpu_native, "set_row_threads", rows.append)
    monkeypatch.setattr(cpu_linear, "set_row_blocks", blocks.append)
    policy = StepThreads(1, 2, 128, block_tokens=512)
    assert [policy.apply(n) for n in (2048, 600, 300, 3, 512)] == [1, 1, 2, 1, 1]
    assert calls == [1, 2, 1, 1] and blocks == [2, 1, 1, 2]  # torch's count, then the blocks' per change
    assert set(rows) == {2}
    assert StepThreads(1, 1, 128, block_tokens=512).apply(4096) == 1  # one thread: nothing to split
    assert StepThreads(1, 1, 128, block_tokens=512).block_tokens is None


def test_prefill_tokens_with_row_blocks_equal_those_on_one_thread(tiny_llama_path, keep_threads, monkeypatch):
    """Row blocks of 16 rows from 32 (the 50-token first step splits; decode steps do not)
    give the tokens of an engine on one thread, and the blocks ran on both threads."""
    torch.set_num_threads(1)
    expected = _run(tiny_llama_path)
    monkeypatch.setattr(cpu_linear, "ROW_BLOCK", 16)
    monkeypatch.setattr(cpu_linear, "ROW_BLOCKS_MIN_ROWS", 32)
    names = []
    real = cpu_linear.PackedLinear.compute

    def compute(self, x, way):  # which thread ran each block
        names.append(threading.current_thread().name)
        return real(self, x, way)

    monkeypatch.setattr(cpu_linear.PackedLinear, "compute", compute)
    policy = _Recording(1, 2, 16, 32)
    assert _run(tiny_llama_path, policy) == expected
    assert policy.steps[0] == (50, 1)  # the prefill step: torch on one thread, the blocks on two
    assert {n.startswith("row-blocks") for n in names} == {True, False}


@pytest.mark.parametrize(("small", "large", "min_tokens", "block_tokens"),
                         [(0, 2, 8, None), (3, 2, 8, None), (1, 2, 0, None), (1, 2, 8, 4)])
def test_bad_policies_are_refused(small, large, min_tokens, block_tokens):
    with pytest.raises(ValueError, match="1 <= small <= large, min_tokens >= 1 and block_tokens >= min_tokens"):
        StepThreads(small, large, min_tokens, block_tokens)
