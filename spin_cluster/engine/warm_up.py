"""Warming an engine up before it serves: one made-up prompt of each power-of-two length
class, a few decode steps after each. Kernels compile a variant per size class of their launch
(Triton's per power-of-two class of the context's pages; the block-sparse prefill also
autotunes per class): a class first met by a served request costs its step about a second a
kernel on a GPU, seconds in the first long request's time to first token.

Then, where decode graphs are captured lazily (Spin's, one per padded batch size and
Select width), a batch that drains: decode steps at every batch size from the largest down
to one. Some kernels compile a variant per batch size class too (the split count of the
decode attention's reduction, Retrieve's pairs per program), and a size first met by a
served step that no captured graph holds runs eagerly with whatever it compiles (steps of
40-120 ms, against 9 ms, as a batch of 16 x 32K requests finished on an H200 before
batches were padded). Dense captures a graph of every batch size at start-up, which runs
each size once the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spin_cluster.engine.cuda_graphs import SpinDecodeGraphs
from spin_cluster.engine.request import SamplingParams
from spin_cluster.sparse.budget import sparse_context_tokens

SHORTEST = 1024  # tokens: the first class warmed
# Past this the first request's own prefill (minutes at 1M tokens) dwarfs its compiles (a few
# seconds), and warming up to a 1M context would take the replica minutes to start.
LONGEST = 131072


def length_classes(lo: int, hi: int) -> list[int]:
    """lo, each power of two between, and hi (1 <= lo <= hi): a prompt of each meets every
    power-of-two size class that prompts of lo..hi tokens meet."""
    pow2 = [1 << k for k in range(lo.bit_length(), hi.bit_length()) if lo < 1 << k < hi]
    return sorted({lo, *pow2, hi})


def warm_lengths(engine, max_tokens: int = 4) -> list[int]:
    """Each power of two of tokens from ``SHORTEST`` and the longest prompt that leaves
    ``max_tokens`` to generate (at most ``LONGEST``), as far as ``engine``'s cache holds one
    such request. (This module sits below ``engine.py``, so ``engine`` is untyped here.)"""
    longest = min(engine.max_model_len - max_tokens, LONGEST)
    lengths = length_classes(min(SHORTEST, longest), longest) if longest >= 1 else []
    return [n for n in lengths if engine.kv.pages_for_tokens(n + max_tokens) <= engine.kv.num_total_pages]


@torch.inference_mode()
def warm_up(engine, lengths: Sequence[int] | None = None, max_tokens: int = 4) -> list[int]:
    """Run one made-up prompt of each of ``lengths`` (default ``warm_lengths``) on an idle
    ``Engine``, ``max_tokens`` decode steps after each, then (where decode graphs are captured
    lazily) a draining batch (``warm_batches``), then zero the engine's running
    totals so that they count served requests only. The prompts share no prefix with each other or with text
    (their ids walk the vocabulary from different starts); in a cache with prefix caching
    their pages stay as idle cached pages, free to take. Returns the lengths run."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up runs on an idle engine: requests are in flight")
    lengths = warm_lengths(engine, max_tokens) if lengths is None else list(lengths)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for k, n in enumerate(lengths):
        engine.generate([_prompt(engine, n, k)], params)
    if isinstance(engine.runner.graphs, SpinDecodeGraphs):
        warm_batches(engine)
    zero_totals(engine)
    return lengths


def _prompt(engine, n: int, k: int) -> list[int]:
    """The k-th made-up prompt of n tokens: ids walking the vocabulary from its own start."""
    start = 1000 + 7919 * k
    return [(start + i) % engine.model.config.vocab_size for i in range(n)]


def zero_totals(engine) -> None:
    """The engine's running totals (the buffer's counters, prefix-cache queries, preemptions)
    back to zero: what a warm-up ran does not count as served."""
    engine.kv.reset_counters()
    engine.scheduler.num_prefix_query_tokens = engine.scheduler.num_prefix_hit_tokens = 0
    engine.num_preemptions_total = 0


def batch_length(engine) -> int:
    """The prompts' length in ``warm_batches``: past the sparse budget's floor and twice its
    budget in tokens (``sparse_context_tokens``: each row selects as wide as a long request's
    would), at least ``SHORTEST``, at most the longest prompt the engine takes (``LONGEST``
    at most)."""
    longest = min(engine.max_model_len - 64, LONGEST)
    return max(1, min(longest, max(SHORTEST, sparse_context_tokens(engine.config.sparse))))


@torch.inference_mode()
def warm_batches(engine, sizes: int | None = None, length: int | None = None) -> list[int]:
    """Decode steps at every batch size from ``sizes`` (default: the decode graphs' largest
    batch, as far as the cache holds that many prompts of ``length`` tokens) down to one, on
    an idle engine: that many made-up prompts of ``length`` tokens (default ``batch_length``)
    are prefilled, then the batch decodes one step at each size while its requests end one by
    one (aborted, which frees their pages as a finished request's). Returns the sizes whose
    decode-only step ran, largest first."""
    if engine.has_unfinished():
        raise RuntimeError("warm_batches runs on an idle engine: requests are in flight")
    length = batch_length(engine) if length is None else length
    graphs = engine.runner.graphs
    most = sizes or min(engine.config.scheduler.max_num_seqs, getattr(graphs, "max_batch", 1))
    # Room for every prompt and the tokens it generates while the others prefill and drain.
    steps = most + -(-most * length // engine.config.scheduler.max_num_batched_tokens) + 8
    need = engine.kv.pages_for_tokens(length + steps)
    most = max(1, min(most, engine.kv.num_total_pages // max(1, need)))
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    ids = [engine.add_request(_prompt(engine, length, 100 + k), params) for k in range(most)]
    sched = engine.scheduler
    for _ in range(steps):  # until every prompt is in and the next step decodes them all
        if not sched.waiting and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in sched.running):
            break
        engine.step()
    ran = []
    # No graph is captured meanwhile: the made-up prompts' Select width is not a served
    # request's, and a graph of it would only hold memory (the steps compile the kernels).
    lazy = isinstance(graphs, SpinDecodeGraphs)
    capture = lazy and graphs.capture
    if lazy:
        graphs.capture = False
    try:
        for rid in reversed(ids):
            ran.append(len(sched.running))
            engine.step()
            engine.abort(rid)
    finally:
        if lazy:
            graphs.capture = capture
    return ran
