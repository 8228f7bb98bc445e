"""Warming an engine up before it serves: one made-up prompt of each power-of-two length
class, a few decode steps after each. Kernels compile a variant per size class of their launch
(Triton's per power-of-two class of the context's pages; the block-sparse prefill also
autotunes per class): a class first met by a served request costs its step about a second a
kernel on a GPU, seconds in the first long request's time to first token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spin_cluster.engine.request import SamplingParams

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
    ``Engine``, ``max_tokens`` decode steps after each, then zero the engine's running totals
    so that they count served requests only. The prompts share no prefix with each other or with text
    (their ids walk the vocabulary from different starts); in a cache with prefix caching
    their pages stay as idle cached pages, free to take. Returns the lengths run."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up runs on an idle engine: requests are in flight")
    lengths = warm_lengths(engine, max_tokens) if lengths is None else list(lengths)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for k, n in enumerate(lengths):
        start = 1000 + 7919 * k
        engine.generate([[(start + i) % vocab for i in range(n)]], params)
    engine.kv.reset_counters()
    engine.scheduler.num_prefix_query_tokens = engine.scheduler.num_prefix_hit_tokens = 0
    engine.num_preemptions_total = 0
    return lengths
