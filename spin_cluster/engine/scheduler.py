"""Continuous batching with chunked prefill and preemption by recomputation.

Each step gets a token budget (``max_num_batched_tokens``). Running requests go first:
decoding requests take one token each, in arrival order, then requests still prefilling take
the next chunk of their prompt, in arrival order. Then waiting requests are admitted, oldest
first, while the budget, the request limit and the KV pages allow: the pages a request will
hold once its whole prompt and ``admission_output_tokens`` of its output are in, beside what
the running requests will still take to get there (``ADMISSION_OUTPUT_TOKENS`` by default; a
test that must force preemptions passes 0, prompts only). Admitting on the first chunk alone
lets many long prompts in at once; halfway through their prompts the cache is full and each
preemption throws away a partly computed context. When a running request cannot get the
page it needs, the newest running request is preempted: its pages are freed and it goes
back to the front of the queue, to be prefilled again (prompt and tokens so far) later.

With prefix caching, an admitted request starts after the cached pages of its leading tokens
(a chat template, a system prompt, its own tokens before a preemption): its first chunk is
a prefill chunk from there. The last known token is always computed, since its logits give
the next token. Once the model has run a step, ``advance`` lets the cache publish the pages
that step filled, and free the pages of sliding-window layers that fell behind their window.

The scheduler sees the KV cache only through ``can_allocate`` / ``allocate`` / ``free`` and
``match_prefix`` / ``commit``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from spin_cluster.config import SchedulerConfig
from spin_cluster.engine.request import Request, RequestStatus
from spin_cluster.kvcache.base import NO_PREFIX, KVCache, PrefixHit

# Output tokens of each running request (up to its max_tokens) that admission keeps room for,
# beside the rest of every running prompt, so that prompts admitted together do not outgrow the
# cache halfway and preempt each other (each preemption recomputes a whole context). It was
# scheduler.admission_output_tokens; only tests that force preemptions moved it (Engine's keyword).
ADMISSION_OUTPUT_TOKENS = 2048


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    # Tokens of this request computed in this step: positions start .. start+num_tokens-1.
    start: int
    num_tokens: int
    # True when the request is past its prompt and computes exactly its last sampled token.
    is_decode: bool

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is in the cache: sample the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


class SchedulerOutput(NamedTuple):
    """A step's work. (A named tuple: one is made every decode step, at a seventh of a frozen
    dataclass's cost.)"""

    # Decode chunks first, then prefill chunks: the model runner relies on this order.
    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCache,
                 admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS) -> None:
        """``admission_output_tokens`` (>= 0): output tokens of each running request admission
        keeps room for; 0: prompts only (a request that grows past it may still preempt the newest)."""
        if admission_output_tokens < 0:
            raise ValueError(f"admission_output_tokens={admission_output_tokens}: must be >= 0")
        self.config = config
        self.kv = kv
        self.admission_output_tokens = admission_output_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Prefix caching, cumulative over admissions: tokens looked up, and those found cached.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request wherever it is and free its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decode: list[ScheduledChunk] = []
        prefill: list[ScheduledChunk] = []
        preempted: list[Request] = []
        # Decoding requests first, then the prompts' chunks, each group in arrival order.
        running = sorted(self.running, key=lambda r: not self._decoding(r))
        for req in running:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_uncomputed_tokens, budget)
            if not self._make_room(req, n, preempted):
                continue
            chunk = self._take(req, n)
            (decode if chunk.is_decode else prefill).append(chunk)
            budget -= n
        if not preempted:
            budget = self._admit(budget, decode, prefill)
        return SchedulerOutput(chunks=decode + prefill, preempted=preempted)

    def schedule_next_decode(self, chunks: list[ScheduledChunk],
                             continues: Callable[[Request], bool]) -> SchedulerOutput | None:
        """The decode step after ``chunks`` (a decode step launched, its tokens not read yet)
        for the same batch, pages allocated; None when the batch may change: requests waiting
        to be admitted, a request gone, one that ``continues`` says must not take a step past
        its pending token (it may end on it, or needs the host's view of it), or pages that
        would need a preemption. Each row computes its pending token. Pages are checked and
        taken row by row, as ``schedule`` does: rows that fit alone may not fit together. The
        rows before one that does not fit keep their new page, which the fresh schedule after
        (decode rows first, in this order) would give them first."""
        if self.waiting or len(self.running) != len(chunks):
            return None
        reqs = [c.request for c in chunks]
        for req in reqs:
            if req.status is not RequestStatus.RUNNING or not continues(req):
                return None
        nxt = []
        for req in reqs:
            if not self.kv.can_allocate(req.request_id, req.num_computed_tokens + 1):
                return None
            self.kv.allocate(req.request_id, req.num_computed_tokens + 1)
            nxt.append(ScheduledChunk(request=req, start=req.num_computed_tokens, num_tokens=1, is_decode=True))
        return SchedulerOutput(nxt, [])

    @staticmethod
    def _decoding(req: Request) -> bool:
        """Past its prompt, with only its last sampled token to compute."""
        return req.num_computed_tokens >= len(req.prompt_token_ids) and req.num_uncomputed_tokens == 1

    def advance(self, chunks: list[ScheduledChunk]) -> None:
        """The model ran ``chunks``: their tokens' K/V are in the cache. Only now may the cache
        share the pages they filled (a request admitted later reads them), or free a window
        layer's pages that only these chunks read. A pipelined step's pending token is computed
        before the host knows it: pages wait for known tokens."""
        for chunk in chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            self.kv.commit(req.request_id, min(req.num_computed_tokens, req.num_tokens), req.token_ids)

    # ---- helpers ------------------------------------------------------------------------------

    def _make_room(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """Preempt the newest running requests until ``req`` can grow by n tokens."""
        while not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _reserved_tokens(self, req: Request) -> int:
        """Tokens admission keeps room for: every known token, and ``admission_output_tokens``
        more of output (those left of its max_tokens at most)."""
        left = req.params.max_tokens - len(req.output_token_ids)
        return req.num_tokens + max(0, min(self.admission_output_tokens, left))

    def _pages_owed(self, chunks: list[ScheduledChunk]) -> int:
        """Pages the running requests will still take to reach their reserved tokens, after
        this step's chunks (allocated already)."""
        held = {c.request.request_id: c.start + c.num_tokens for c in chunks}
        pages = self.kv.pages_for_tokens
        return sum(max(0, pages(self._reserved_tokens(r)) - pages(held.get(r.request_id, r.num_computed_tokens)))
                   for r in self.running)

    def _admit(self, budget: int, decode: list[ScheduledChunk], prefill: list[ScheduledChunk]) -> int:
        if not self.waiting:
            return budget  # (the pages owed are summed only when someone waits)
        owed, pages = self._pages_owed(decode + prefill), self.kv.pages_for_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._prompt_shared(req):
                break
            # Nothing of a waiting request is computed (new, or preempted and recomputed).
            prefix = self._cached_prefix(req)
            n = req.num_tokens - prefix.num_tokens
            # Its own pages to come (past a cached prefix) and the running ones' must fit. With
            # nothing running it goes in regardless: a request that can never fit was refused
            # when it arrived, and one that needs the whole cache must not wait forever.
            own = pages(self._reserved_tokens(req)) - pages(prefix.num_tokens)
            if self.running and own + owed > self.kv.num_free_pages:
                break
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            queued = len(self.waiting) - 1  # behind this one: they will want buffer shares too
            if not self.kv.can_allocate(req.request_id, prefix.num_tokens + n, queued, prefix):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if self.kv.prefix_caching:
                self.num_prefix_query_tokens += req.num_tokens
                self.num_prefix_hit_tokens += prefix.num_tokens
            req.num_computed_tokens = prefix.num_tokens
            # (a preempted request whose every token but its last is cached starts with a decode)
            chunk = self._take(req, n, queued, prefix)
            (decode if chunk.is_decode else prefill).append(chunk)
            budget -= n
            owed += max(0, own - (pages(prefix.num_tokens + n) - pages(prefix.num_tokens)))
        return budget

    @staticmethod
    def _prompt_shared(req: Request) -> bool:
        """A request made to share another's prompt (``prefill_after``: a choice of the same n)
        is admitted once that one has computed its prompt, or has ended; until then it and those
        behind it wait, as they would behind any request that does not fit."""
        first = req.prefill_after
        if first is None or first.is_finished or first.num_computed_tokens >= len(first.prompt_token_ids):
            req.prefill_after = None  # (no reference kept to a finished request)
            return True
        return False

    def _cached_prefix(self, req: Request) -> PrefixHit:
        """Cached pages of the request's known tokens but the last, which is always computed.
        None for a request that wants its prompt's logprobs: those need every prompt position."""
        if not self.kv.prefix_caching or req.params.prompt_logprobs is not None:
            return NO_PREFIX
        return self.kv.match_prefix(req.token_ids(0, req.num_tokens - 1))

    def _take(self, req: Request, n: int, num_queued: int = 0, prefix: PrefixHit = NO_PREFIX) -> ScheduledChunk:
        start = req.num_computed_tokens
        self.kv.allocate(req.request_id, start + n, num_queued, prefix)
        is_decode = start >= len(req.prompt_token_ids) and n == 1 and req.num_uncomputed_tokens == 1
        return ScheduledChunk(request=req, start=start, num_tokens=n, is_decode=is_decode)
