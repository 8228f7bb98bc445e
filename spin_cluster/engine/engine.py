"""The engine: requests in, tokens out, one ``step()`` at a time.

    engine = Engine(SpinConfig.from_dict({"model": {"path": "/models/smollm2"}}))
    outs = engine.generate(["The capital of France is"], SamplingParams(temperature=0))
    for out in engine.stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(out.new_text, end="")
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from spin_cluster.config import SpinConfig
from spin_cluster.engine.model_runner import load_engine_model
from spin_cluster.engine.stack import build_stack
from spin_cluster.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from spin_cluster.engine.sampler import Sampler
from spin_cluster.engine.scheduler import ADMISSION_OUTPUT_TOKENS, ScheduledChunk, Scheduler, SchedulerOutput
from spin_cluster.engine import warm_up as warming
from spin_cluster.engine.stats import StepStats
from spin_cluster.engine.cache_builder import build_cache
from spin_cluster.engine.detokenizer import Detokenizer
from spin_cluster.engine.grammar import Grammars
from spin_cluster.engine.outputs import OutputProcessor
from spin_cluster.kvcache.buffer_policy import DEFAULT_POLICY, BufferPolicy
from spin_cluster.models import cpu_linear
from spin_cluster.tokenizer import Tokenizer


@dataclass(slots=True)
class _Launched:
    """A step that ``_launch`` ran and ``_retire`` has not read yet. Synchronous: its outputs,
    sampled on the host at launch. Pipelined (``outputs`` None): its tokens on the device and on
    their way to the host."""

    chunks: list[ScheduledChunk]  # in the batch's order
    num_tokens: int
    t0: float  # when the step was scheduled
    num_preempted: int
    outputs: list[RequestOutput] | None = None
    tokens: torch.Tensor | None = None  # [B] int64 sampled on the device (the next step's input ids)
    host: torch.Tensor | None = None  # [B + 4] int64 (pinned on CUDA): the tokens, then the buffer counters
    done: torch.cuda.Event | None = None  # recorded after the copies to ``host`` (None on the CPU)


class Engine:
    # Head-parallel engines step their ranks in lockstep and turn pipelining off.
    supports_async_decode = True
    # float32 GEMMs on the CPU are prepacked for oneDNN (head-parallel ranks hold split-K
    # weight shards: no)
    packs_cpu_gemms = True

    def __init__(self, config: SpinConfig | None = None, *, decode_attention: str = "auto", progress: bool = True,
                 buffer_policy: BufferPolicy = DEFAULT_POLICY, pack_cpu_gemms: bool = True,
                 admission_output_tokens: int = ADMISSION_OUTPUT_TOKENS) -> None:
        """``buffer_policy``: the offloaded cache's buffer mechanisms past the config's
        (``kvcache.buffer_policy``); studies and tests set it, serving keeps the default.
        ``pack_cpu_gemms`` False: the plain weights on the CPU (tests compare the packs with them).
        ``admission_output_tokens``: the scheduler's room for each running request's output
        (``Scheduler``); tests pass 0 (prompts only) to force preemptions on a small cache."""
        self.config = config = config or SpinConfig()
        self.buffer_policy = buffer_policy

        def pack(model):
            if pack_cpu_gemms and model.device.type == "cpu" and self.packs_cpu_gemms:
                model.pack_for_cpu()
                # Decode's 1-3 rows: the fastest of the plain weight, the pack and the pack
                # padded to four rows on this CPU, timed at this thread's torch thread count.
                cpu_linear.plan_small_rows(cpu_linear.packs_of(model))

        stack = build_stack(config, lambda path, dtype, device: self._load_model(path, dtype, device, progress),
                            lambda model, dtype, device, max_len: self._build_cache(model, dtype, device, max_len,
                                                                                    decode_attention),
                            progress=progress, prepare=pack)
        self.device, self.dtype, self.model = stack.device, stack.dtype, stack.model
        self.max_model_len, self.kv, self.runner = stack.max_model_len, stack.kv, stack.runner
        self.tokenizer = Tokenizer(stack.path)
        mc, sc = self.model.config, config.scheduler
        self.scheduler = Scheduler(sc, self.kv, admission_output_tokens)
        self.sampler = Sampler(self.device)
        eos_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer.hf_tokenizer, mc.vocab_size, sorted(eos_ids))
        self.output_processor = OutputProcessor(self.model, self.sampler, self.grammars, eos_ids, self.max_model_len,
                                                self._finish)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_stats = StepStats()
        self.num_preemptions_total = 0
        auto = sc.async_decode is None
        self.async_decode = self.supports_async_decode and (self.device.type == "cuda" if auto else sc.async_decode)
        self._inflight: list[_Launched] = []  # launched, not read yet, oldest first: one at most between steps
        pin = self.device.type == "cuda"
        self._host_bufs = [torch.empty(sc.max_num_seqs + 4, dtype=torch.long, pin_memory=pin)
                           for _ in range(2)] if self.async_decode else []
        self.num_pipelined_steps = 0  # decode steps launched before the previous one's tokens were read

    # ---- construction hooks (a head-parallel rank shards the model and sizes its own cache) ----

    def _load_model(self, path: str, dtype: torch.dtype, device: torch.device, progress: bool) -> torch.nn.Module:
        return load_engine_model(self.config, path, dtype, device, progress)

    def _build_cache(self, model, dtype: torch.dtype, device: torch.device, max_model_len: int, decode_attention: str):
        """(kv manager, attention backend) for ``model`` (``engine.stack.build_stack``'s order)."""
        return build_cache(self.config, model.config, dtype, device, max_model_len, decode_attention,
                           self.buffer_policy)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_after: str | None = None,
    ) -> str:
        """Queue a request; returns its id. ``prefill_after``: a request with the same prompt
        (an earlier choice of the same n); this one waits until that one's prompt is in the
        cache, and with prefix caching takes its pages instead of computing them again."""
        params = params or SamplingParams()
        params.check_vocab(self.model.config.vocab_size)
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompt(ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_output is not None:
            self.grammars.start(request_id, params.structured_output)
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params, prompt=text,
                      detokenizer=Detokenizer(self.tokenizer, params.stop),
                      prefill_after=self._requests.get(prefill_after) if prefill_after else None)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is unknown or already done."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, FinishReason.ABORT)
        return self.output_processor.final_output(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """End ``req`` and free what it holds: an abort, or the output processor's verdict on
        its last token."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_s = time.monotonic()
        self.scheduler.finish(req)
        self.sampler.forget(req.request_id)
        self.grammars.forget(req.request_id)
        self._requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run the model and report every request that advanced. One path, vLLM V1's engine
        core loop (schedule, execute, update from the output) over a queue of two steps:
        1. ``_schedule``: the work after what is in flight, from the scheduler: a fresh batch,
           the in-flight batch's next decode step, or nothing new;
        2. ``_launch`` runs it, pipelined where ``_may_pipeline`` lets every row (sampled on
           the device, its tokens read later), else sampled at once; 1 and 2 go once more
           while only a pipelined step is in flight (its tokens are the next one's input ids);
        3. ``_retire`` reads the oldest launched step: its outputs, its ``last_stats``.
        Where vLLM returns nothing from a call that only fills its queue, the second launch
        keeps one step's tokens in every call, as the plain loop does; with ``async_decode`` a
        decode step is read while the GPU runs the next. A request that stops on a token
        computes one step more, which is dropped."""
        inflight = self._inflight
        while not inflight or (len(inflight) == 1 and inflight[0].outputs is None):
            t0 = time.perf_counter()
            work = self._schedule()
            if work is None:
                break
            inflight.append(self._launch(work, t0))
        return self._retire(inflight.pop(0))

    def _schedule(self) -> SchedulerOutput | None:
        """After a step in flight: its batch's next decode, pages allocated, or None when the
        batch may change (that step is read first). A fresh batch is formed with nothing in
        flight: also after a step whose every request has ended, once the device is done with
        it (its tokens are dropped). So the engine, which knows what is in flight, picks the
        scheduler's question: no fresh batch (admissions, preemptions) is formed beside one."""
        if self._inflight:
            cur = self._inflight[-1]
            nxt = self.scheduler.schedule_next_decode(cur.chunks, self._may_pipeline)
            if nxt is not None or any(c.request.status is RequestStatus.RUNNING for c in cur.chunks):
                return nxt
            self._inflight.pop()
            if cur.done is not None:
                cur.done.synchronize()
        return self.scheduler.schedule()

    def _launch(self, work: SchedulerOutput, t0: float) -> _Launched:
        """Run ``work``. Pipelined: a step after one in flight (the scheduler asked
        ``_may_pipeline`` of its rows), or a fresh one whose rows all decode and may be: its
        tokens (and the buffer's counters) start on their way to the host, unread. Its input
        ids: the tokens of the step in flight, on the device."""
        chunks, num_preempted = work.chunks, len(work.preempted)
        self.num_preemptions_total += num_preempted
        prev = self._inflight[-1] if self._inflight else None
        pipelined = prev is not None or (self.async_decode and chunks and all(
            c.is_decode and self._may_pipeline(c.request, 0) for c in chunks))
        if not pipelined:
            return self._run(chunks, work.num_tokens, t0, num_preempted)
        logits = self.runner.execute(chunks, prev.tokens if prev else None).logits
        self.scheduler.advance(chunks)  # the K/V writes are queued on the device before any later reader
        reqs = [c.request for c in chunks]
        tokens = self.sampler.sample_tensor(logits, [r.request_id for r in reqs], [r.params for r in reqs])  # [B]
        host = self._host_bufs[self.num_pipelined_steps % 2]  # the other one may still be read
        B = len(chunks)
        host[:B].copy_(tokens, non_blocking=True)
        if self.kv.buffer is not None:
            host[B : B + 4].copy_(self.kv.buffer.counters, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.num_pipelined_steps += 1
        return _Launched(chunks, B, t0, num_preempted, None, tokens, host, done)

    def _may_pipeline(self, req: Request, pending: int = 1) -> bool:
        """Whether ``req``'s next token may be sampled on the device and read a call later,
        with ``pending`` of its tokens launched and unread (1: a row of the step in flight, as
        the scheduler asks). Not with a grammar (its mask depends on the token before, unread
        yet), logprobs (read beside the sampled token on the host) or a min_tokens ban left on
        that token (it needs the host's count of tokens); nor when a pending token is its last
        (max_tokens, the model's context): the step would compute past its end. Greedy and
        sampled rows (their logit_bias, temperature, top-k, top-p and seeds) are sampled on
        the device at launch (``Sampler.sample_tensor``); a seeded row draws from its own
        generator in step order either way, so it gives the plain loop's tokens."""
        p = req.params
        n = len(req.output_token_ids) + pending  # its tokens once those are read
        return (p.structured_output is None and p.logprobs is None and p.min_tokens <= n < p.max_tokens
                and req.num_computed_tokens + pending < self.max_model_len)

    def _run(self, chunks: list[ScheduledChunk], num_tokens: int, t0: float, num_preempted: int) -> _Launched:
        """A synchronous step: its prompts scored and its tokens sampled on the host now."""
        outputs: list[RequestOutput] = []
        if chunks:
            step = self.runner.execute(chunks)
            self.scheduler.advance(chunks)
            self.output_processor.score_prompts(step.prompt)
            if step.sampled:
                outputs = self.output_processor.sample(step.logits, [c.request for c in step.sampled])
        return _Launched(chunks, num_tokens, t0, num_preempted, outputs)

    def _retire(self, step: _Launched) -> list[RequestOutput]:
        """``step``'s outputs, its tokens read now if it was pipelined (where a row's request
        ended on an earlier token or was aborted, that row's token is dropped); its stats
        become ``last_stats``."""
        outputs, counters = step.outputs, None
        if outputs is None:
            if step.done is not None:
                step.done.synchronize()  # this step's copies only: the next step keeps running
            B = len(step.chunks)
            values = step.host[: B + 4].tolist()
            outputs = [self.output_processor.append_token(c.request, tok) for c, tok in zip(step.chunks, values)
                       if c.request.status is RequestStatus.RUNNING]
            if self.kv.buffer is not None:
                counters = values[B:]
        self.last_stats = self._stats(step.t0, step.num_tokens, step.num_preempted, counters)
        return outputs

    # ---- stats --------------------------------------------------------------------------------

    def _stats(self, t0: float, num_tokens: int, num_preempted: int, counters: list[int] | None = None) -> StepStats:
        return StepStats(
            num_running=self.scheduler.num_running(),
            num_waiting=self.scheduler.num_waiting(),
            num_batched_tokens=num_tokens,
            num_preempted=num_preempted,
            preemptions_total=self.num_preemptions_total,
            num_free_pages=self.kv.num_free_pages,
            num_total_pages=self.kv.num_total_pages,
            step_s=time.perf_counter() - t0,
            prefix_cache_queries_total=self.scheduler.num_prefix_query_tokens,
            prefix_cache_hits_total=self.scheduler.num_prefix_hit_tokens,
            **self._cache_stats(counters),
        )

    def _cache_stats(self, counters: list[int] | None = None) -> dict[str, int]:
        buffer = self.kv.buffer
        if buffer is None:
            return {}
        # one read per step, or the counters copied with a pipelined step's tokens
        lookups, hits, misses, evicted = counters if counters is not None else buffer.counters.tolist()
        meta = self.kv.metadata_bytes()
        return {
            "buffer_lookups_total": lookups,
            "buffer_hits_total": hits,
            "buffer_misses_total": misses,
            "evicted_pages_total": evicted,
            "retrieved_bytes_total": misses * self.kv.host.page_bytes,  # what crossed PCIe
            "spilled_pages_total": self.kv.num_spilled_segments * self.kv.host.segment_pages,
            "metadata_gpu_bytes": meta["gpu"] + meta["gpu_buffer"],
            "metadata_host_bytes": meta["host"],
            "metadata_flat_gpu_bytes": meta["flat_gpu"],
        }

    # ---- convenience --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch to completion; outputs in the order of ``prompts``."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's output after every step that advances it, until it finishes.

        Other requests in the engine advance in the same steps. Closing the iterator early
        aborts the request and frees its pages.
        """
        rid = self.add_request(prompt, params)
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.abort(rid)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.tokenizer.chat_prompt_ids(messages)], params)[0]

    # ---- warm-up ------------------------------------------------------------------------------

    def warm_lengths(self, max_tokens: int = 4) -> list[int]:
        """``warming.warm_lengths``: the prompt lengths that meet every size class."""
        return warming.warm_lengths(self, max_tokens)

    def warm_up(self, lengths: Sequence[int] | None = None, max_tokens: int = 4) -> list[int]:
        """``warming.warm_up``: made-up prompts of ``lengths`` (default ``warm_lengths``)
        before serving, so that no request waits for a compile; returns the lengths run."""
        return warming.warm_up(self, lengths, max_tokens)

    # ---- sizing and checks ----------------------------------------------------------------------

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                f"tokens, and at least one must be left to generate. Shorten the prompt."
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        need = self.kv.pages_for_tokens(len(ids) + 1)
        if need > self.kv.num_total_pages:
            raise ValueError(
                f"the prompt needs {need} KV pages but the cache has {self.kv.num_total_pages}; "
                f"raise cache.kv_cache_gib or shorten the prompt"
            )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running}
        held = set(self.kv.request_ids())
        if not held <= live | {r.request_id for r in self.scheduler.waiting}:
            raise AssertionError(f"pages held by requests that are not scheduled: {sorted(held - live)}")
