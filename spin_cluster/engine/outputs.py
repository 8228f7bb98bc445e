"""What the host makes of a step's logits: each request's next token, its text so far, whether
it has finished, and the ``RequestOutput`` the caller sees (vLLM spreads this over its
sampler's logits processors, its scheduler's stop check and its output processor).

    logits [B, V] ──raw logprobs; min_tokens bans; grammar mask──▶ Sampler ──▶ token ids [B]
    token id ──detokenize; stop strings, stop ids, length──▶ finished? ──▶ RequestOutput

The engine owns one ``OutputProcessor`` and calls it after each forward: ``score_prompts``
and ``sample`` in a synchronous step, ``append_token`` for each row of a pipelined step once
its tokens (sampled on the device) are read. What a request that has ended gives back (its
pages, the sampler's and the grammar's state for it) is the engine's to free: the processor
calls the engine's ``finish``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spin_cluster.engine.grammar import Grammars
from spin_cluster.engine.logprobs import TokenLogprobs, raw_logprobs, token_logprobs
from spin_cluster.engine.request import FinishReason, Request, RequestOutput
from spin_cluster.engine.sampler import Sampler
from spin_cluster.engine.scheduler import ScheduledChunk

# Prompt positions whose logits a prompt_logprobs request holds at once: [256, V] float32 is
# 50 MB at SmolLM2's vocabulary, 130 MB at Llama 3's.
PROMPT_LOGITS_ROWS = 256


@dataclass(eq=False)
class OutputProcessor:
    """Sampled tokens -> requests' outputs. No slots: a profile wraps ``append_token`` on the
    instance (``benchmarks/profile_tools.labelled``)."""

    model: torch.nn.Module  # computes the prompt logprobs' logits
    sampler: Sampler
    grammars: Grammars
    eos_ids: set[int]  # the model's and the tokenizer's end-of-sequence ids
    max_model_len: int
    # The engine's bookkeeping for a request that has ended: called once, before its last
    # output is made.
    finish: Callable[[Request, FinishReason], None]

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[RequestOutput]:
        """logits [B, V] of ``reqs``' last positions -> each request's next token and output."""
        counts = [r.params.logprobs for r in reqs]
        rows, raw = raw_logprobs(logits, counts)  # before any processor below changes the logits
        self._suppress_early_stops(logits, reqs)
        self.grammars.mask(logits, [r.request_id for r in reqs])
        token_ids = self.sampler.sample(logits, [r.request_id for r in reqs], [r.params for r in reqs])
        found = token_logprobs(raw, [token_ids[i] for i in rows], [counts[i] for i in rows]) if rows else []
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        for i, lp in zip(rows, found):
            logprobs[i] = lp
        return [self.append_token(req, tok, lp) for req, tok, lp in zip(reqs, token_ids, logprobs)]

    def score_prompts(self, prompt: list[tuple[ScheduledChunk, torch.Tensor]]) -> None:
        """Each chunk's [m, hidden] states -> the logprobs of its prompt tokens start+1 ..
        start+m, kept on the request, ``PROMPT_LOGITS_ROWS`` positions at a time. A chunk
        recomputed after a preemption scored them already."""
        for chunk, hidden in prompt:
            req = chunk.request
            if chunk.start != len(req.prompt_logprobs):
                continue
            for i in range(0, hidden.shape[0], PROMPT_LOGITS_ROWS):
                first = chunk.start + 1 + i  # the first token these rows score
                block = torch.log_softmax(self.model.compute_logits(hidden[i : i + PROMPT_LOGITS_ROWS]), dim=-1)
                targets = req.prompt_token_ids[first : first + block.shape[0]]
                req.prompt_logprobs.extend(token_logprobs(block, targets, [req.params.prompt_logprobs] * len(targets)))

    def _suppress_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """min_tokens: no end-of-sequence or stop token until that many are generated."""
        for i, req in enumerate(reqs):
            if len(req.output_token_ids) < req.params.min_tokens:
                banned = set(req.params.stop_token_ids)
                if not req.params.ignore_eos:
                    banned |= self.eos_ids
                if banned:
                    logits[i, sorted(banned)] = float("-inf")

    def append_token(self, req: Request, token_id: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """``req``'s next token, sampled: its text, its end if this token ends it, its output."""
        now = time.monotonic()
        if req.first_token_s is None:
            req.first_token_s = now
        old_text = req.output_text
        req.output_token_ids.append(token_id)
        reason = self._finish_reason(req, token_id)
        if req.detokenizer.add(req.output_token_ids, finishing=reason is not None):
            reason = FinishReason.STOP
        req.output_text = req.detokenizer.visible_text(finished=reason is not None)
        if reason is not None:
            self.finish(req, reason)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        return request_output(req, [token_id], req.output_text[len(old_text) :], [logprobs] if logprobs else [])

    def _finish_reason(self, req: Request, token_id: int) -> FinishReason | None:
        p = req.params
        if req.request_id in self.grammars and self.grammars.accept(req.request_id, token_id):
            return FinishReason.STOP  # the grammar has terminated
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def final_output(self, req: Request) -> RequestOutput:
        """The last output of ``req``, ended without a new token (aborted): the text held back
        for stop strings, released."""
        old_text = req.output_text
        req.output_text = req.detokenizer.visible_text(finished=True)
        return request_output(req, [], req.output_text[len(old_text) :])


def request_output(req: Request, new_ids: list[int], new_text: str,
                   new_logprobs: list[TokenLogprobs] = ()) -> RequestOutput:
    """What the caller sees of ``req`` after a step: all of it so far, and what is new."""
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        text=req.output_text,
        token_ids=list(req.output_token_ids),
        new_text=new_text,
        new_token_ids=new_ids,
        finished=req.is_finished,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        new_logprobs=list(new_logprobs),
        logprobs=list(req.output_logprobs),
        prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
    )
