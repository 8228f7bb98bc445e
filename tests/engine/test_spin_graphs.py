"""Decode steps of the offloaded cache from device tensors only (``SpinDecodeGraphs``): on
the CPU the static path runs eagerly and must give the plain path's tokens, counters and
shares; on CUDA the same path is captured in CUDA graphs and replayed."""

import pytest
import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs
from spin_cluster.engine.spin_attention import SpinAttention
from spin_cluster.kvcache.buffer_policy import BufferPolicy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village, there lived",
    "List of prime numbers: 2, 3, 5, 7,",
]


def _engine(path, device="cpu", graphs=False, budget=24, buffer_pages=10, max_len=256, algorithm="quest"):
    cfg = {
        "model": {"path": path, "device": device, "dtype": "float32", "max_model_len": max_len,
                  "cuda_graphs": graphs},
        # Every page's home on the host: the buffer's lookups and evictions are what is compared.
        "cache": {"page_size": 4, "kind": "offloaded", "gpu_home_fraction": 0.0},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64},
        "sparse": {"algorithm": algorithm, "budget": budget, "sink_tokens": 4, "local_tokens": 8},
    }
    return Engine(SpinConfig.from_dict(cfg), progress=False, buffer_policy=BufferPolicy(pages_per_head=buffer_pages))


def _generate(engine, max_tokens=(30, 44, 18, 37)):
    # Different lengths: the batch shrinks 4 -> 3 -> 2 -> 1 as requests finish.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = engine.generate(PROMPTS, params)
    engine.check_integrity()
    return [o.token_ids for o in outs], engine.kv.buffer.counters.tolist()


def test_decode_pages_round_up_to_an_eighth_of_a_power_of_two(smollm2_path):
    att = _engine(smollm2_path, max_len=8192).runner.attention  # page 4: 2048 pages per request
    assert isinstance(att, SpinAttention)
    assert att.decode_pages(1) == 16  # at least 16
    assert att.decode_pages(4 * 16) == 16 and att.decode_pages(4 * 16 + 1) == 32
    assert att.decode_pages(4 * 1024) == 1024
    assert att.decode_pages(4 * 1025) == 1280  # 2048 / 8 = 256-page steps
    assert att.decode_pages(4 * 1900) == 2048 and att.decode_pages(8192) == 2048  # capped at a request's pages
    widths = {att.decode_pages(n) for n in range(4 * 1024, 4 * 2048 + 1, 4)}
    assert widths == {1024, 1280, 1536, 1792, 2048}  # a handful of shapes, not a thousand


@pytest.mark.parametrize("algorithm", ["quest", "labels"])
def test_static_decode_path_equals_the_plain_path_on_the_cpu(smollm2_path, algorithm):
    plain = _engine(smollm2_path, algorithm=algorithm)
    assert plain.runner.graphs is None  # no CUDA: no graphs
    want_tokens, want_counters = _generate(plain)
    eng = _engine(smollm2_path, algorithm=algorithm)
    static = SpinDecodeGraphs(eng.model, eng.runner.attention, max_batch=8, capture=False)
    eng.runner.graphs = static
    calls = []
    forward = static._forward
    static._forward = lambda B, P: calls.append((B, P)) or forward(B, P)
    tokens, counters = _generate(eng)
    assert tokens == want_tokens
    assert counters == want_counters  # same lookups, hits, misses and evictions
    assert counters[3] > 0  # the shares were tight enough to evict
    # Every step took the static path; three requests ran padded to four with the padding
    # row, which the counters leave out and which holds no request's state.
    assert {b for b, _ in calls} == {1, 2, 4}
    assert static.padding_row == eng.kv.padding_row() == 8  # the row past max_num_seqs'
    assert eng.kv.request_ids() == []
    assert static.num_graphs == 0


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["quest", "labels"])
def test_spin_decode_graphs_give_the_eager_tokens(smollm2_path, algorithm):
    eager = _engine(smollm2_path, device="cuda", graphs=False, algorithm=algorithm)
    assert eager.runner.graphs is None
    want_tokens, want_counters = _generate(eager)
    eng = _engine(smollm2_path, device="cuda", graphs=True, algorithm=algorithm)
    graphs = eng.runner.graphs
    assert isinstance(graphs, SpinDecodeGraphs)
    tokens, counters = _generate(eng)
    assert tokens == want_tokens
    assert counters == want_counters
    # 43 decode steps as the batch drains 4 -> 1 over two Select widths: the full batch's
    # graph is captured after two eager steps (capture_after=2), and the smaller batches
    # replay it padded with the padding row (each size leaves before it would get its own).
    assert graphs.captures >= 1 and graphs.replays >= 43 - 2 * graphs.captures - 2, (graphs.captures, graphs.replays)
    assert graphs.padded_replays > 0
    # Finished requests left nothing behind in the host tier or the buffer.
    assert eng.kv.buffer.num_free_slots == eng.kv.buffer.num_slots


def test_spin_graphs_capture_a_shape_only_once_it_repeats(smollm2_path):
    """A shape is captured after capture_after eager steps of it in a row: a batch that changes
    every step (a draining batch) runs eagerly instead of paying a capture at every size."""
    eng = _engine(smollm2_path, device="cpu", graphs=False)
    graphs = SpinDecodeGraphs(eng.model, eng.runner.attention, max_batch=8, capture_after=2)
    steady = [graphs._should_capture((4, 16)) for _ in range(3)]
    assert steady == [False, True, True]  # (run() replays once captured, and asks no more)
    drain = [graphs._should_capture((b, 16)) for b in (7, 6, 5, 4, 3)]
    assert drain == [False] * 5
    assert [graphs._should_capture((3, 32)) for _ in range(2)] == [False, True]  # a new width: its own streak
    graphs.max_graphs = 0
    assert not graphs._should_capture((3, 32))


class _Graph:
    """A captured graph's stand-in: counts its replays."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_draining_batch_replays_the_full_batchs_graph_padded(smollm2_path):
    """A batch smaller than a captured graph of its width runs in that graph, its tail rows
    the padding row's (token 0 at position 0); a smaller size that stays for
    ``capture_after_padded`` steps gets its own graph. On the CPU the graphs are stand-ins."""
    eng = _engine(smollm2_path)
    graphs = SpinDecodeGraphs(eng.model, eng.runner.attention, max_batch=8, capture_after_padded=3)
    pad = graphs.padding_row
    assert pad == 8 and graphs.sizes == [1, 2, 4, 8]
    full = _Graph()
    graphs._graphs[(8, 16)] = full
    graphs._hidden[(8, 16)] = torch.arange(8.0)[:, None]
    eager, captured = [], []
    graphs._forward = lambda B, P: eager.append((B, P)) or torch.zeros(B, 1)

    def capture(key):
        captured.append(key)
        graphs._graphs[key], graphs._hidden[key] = _Graph(), torch.zeros(key[0], 1)

    graphs._capture = capture

    class Chunk:
        def __init__(self, start):
            self.start, self.is_decode = start, True

    def step(B, start=20):
        ids = torch.arange(B) + 100
        out = graphs.run(ids, torch.full((B,), start), torch.arange(B), [Chunk(start)] * B)
        assert out.shape[0] == B
        return out

    for B in (7, 5, 3):  # the drain: every size in the full batch's graph
        assert torch.equal(step(B), torch.arange(float(B))[:, None])
        assert graphs.rows[B:].tolist() == [pad] * (8 - B)
        assert graphs.positions[B:].tolist() == [0] * (8 - B) and graphs.input_ids[B:].tolist() == [0] * (8 - B)
    assert full.replays == 3 and graphs.padded_replays == 3 and eager == []
    for _ in range(2):  # one request alone: padded twice, then its own graph (eager once, captured)
        step(1)
    assert eager == [] and captured == []
    step(1)
    assert eager == [(1, 16)] and captured == [(1, 16)]
    step(1)
    assert graphs._graphs[(1, 16)].replays == 1 and full.replays == 5
    step(3, start=200)  # a new width: no graph holds it; eager, padded to 4
    assert eager[-1] == (4, 64) and graphs.rows[3] == pad
