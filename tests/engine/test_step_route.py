"""One decode step of the Spin backend crosses few package files, in one direction.

The route is what ``docs/architecture.md`` draws: the backend's ``begin_step``, its
``forward`` per layer and ``end_step``, profiled with ``sys.setprofile`` on the CPU. Every
Python call into a file of this repository counts; a file that calls a file that calls it
back (a callback up the layers) breaks "one direction".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from spin_cluster.config import SpinConfig
from spin_cluster.engine import Engine, SamplingParams
from spin_cluster.kvcache.buffer_policy import BufferPolicy

REPO = Path(__file__).resolve().parents[2]
ROOTS = tuple(str((REPO / name).resolve()) + "/" for name in ("spin_cluster", "kernels"))
# 8 files before pages could live at home on the GPU; kvcache/homes.py (which tier a page
# lives in, and the recency that orders spills) is the ninth, called by the transfer alone;
# sparse/contract.py is the tenth, Quest's index page ids (``index_page_ids``: the index sized
# by what the cache holds), called by the algorithm alone.
MAX_PACKAGE_FILES = 10


def _ours(filename: str) -> str | None:
    for root in ROOTS:
        if filename.startswith(root):
            return str(Path(filename).relative_to(REPO))
    return None


def _route(engine: Engine) -> tuple[list[str], set[tuple[str, str]]]:
    """Files the backend's next decode step calls into, first call first, and the
    (caller file, callee file) pairs."""
    files: list[str] = []
    edges: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _ours(frame.f_code.co_filename)
        if callee is None:
            return
        files.append(callee)
        caller = frame.f_back
        while caller is not None and _ours(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None and _ours(caller.f_code.co_filename) != callee:
            edges.add((_ours(caller.f_code.co_filename), callee))

    backend = engine.runner.attention
    for name in ("begin_step", "forward", "end_step"):
        method = getattr(backend, name)

        def profiled(*args, _method=method, **kwargs):
            sys.setprofile(profile)
            try:
                return _method(*args, **kwargs)
            finally:
                sys.setprofile(None)

        setattr(backend, name, profiled)
    engine.step()
    for name in ("begin_step", "forward", "end_step"):
        delattr(backend, name)
    return list(dict.fromkeys(files)), edges


@pytest.mark.parametrize("sparse", [
    {"algorithm": "quest"},
    {"algorithm": "labels", "options": {"resident_margin": 0.5}},  # the bundled `spin` config's Select
], ids=["quest", "labels-hysteresis"])
def test_a_spin_decode_step_crosses_few_files_in_one_direction(smollm2_path, sparse):
    cfg = SpinConfig.from_dict({
        "model": {"path": smollm2_path, "device": "cpu", "dtype": "float32", "max_model_len": 512},
        "cache": {"page_size": 4, "kind": "offloaded"},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 256},
        "sparse": {"budget": 32, "sink_tokens": 4, "local_tokens": 8, **sparse},
    })
    engine = Engine(cfg, progress=False, buffer_policy=BufferPolicy(segment_pages=4))
    engine.add_request(list(range(100, 300)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):  # the prefill, then decode steps: the buffer holds pages
        engine.step()
    (request,) = engine.scheduler.running
    assert request.num_computed_tokens > 200  # past its prompt: the next step decodes
    files, edges = _route(engine)
    package = [f for f in files if f.startswith("spin_cluster/")]
    assert "spin_cluster/engine/spin_attention.py" in package and "spin_cluster/kvcache/transfer.py" in package
    assert len(package) <= MAX_PACKAGE_FILES, package
    both_ways = sorted((a, b) for a, b in edges if (b, a) in edges)
    assert not both_ways, both_ways
