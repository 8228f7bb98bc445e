"""Request state, sampling parameters and what the engine hands back per request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from spin_cluster.engine.detokenizer import Detokenizer
from spin_cluster.engine.grammar import StructuredOutput
from spin_cluster.engine.logprobs import TokenLogprobs, check_count


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, with vLLM's names and defaults."""

    # 0 means greedy; > 0 scales logits. Range [0, inf).
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p. (0, 1].
    top_p: float = 1.0
    # Keep the k most likely tokens; 0 or -1 disables. >= -1.
    top_k: int = 0
    # Seed of this request's own generator; None draws from the engine's.
    seed: int | None = None
    # Most tokens to generate, >= 1.
    max_tokens: int = 16
    # Generation stops when the text contains one of these; it is not included in the output.
    stop: tuple[str, ...] = ()
    # Generation stops when one of these tokens is sampled (kept in the output ids).
    stop_token_ids: tuple[int, ...] = ()
    # Keep going past the model's end-of-sequence tokens.
    ignore_eos: bool = False
    # End-of-sequence and stop tokens cannot be sampled before this many tokens, >= 0.
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before sampling; bias in [-100, 100] (-100
    # bans a token in practice, 100 all but forces it). A dict is accepted and sorted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output must match this grammar (JSON); None: free text. A dict is taken as its fields.
    structured_output: StructuredOutput | None = None
    # Log-probabilities of each sampled token with this many most likely tokens beside it
    # (vLLM's ``logprobs``); None: none. [0, 20].
    logprobs: int | None = None
    # The same for every prompt token but the first (vLLM's ``prompt_logprobs``): the prompt
    # is then computed whole, never taken from the prefix cache. None: none. [0, 20].
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: must be >= 1, or 0 / -1 to disable")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens}: must be in [0, max_tokens]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._check_logit_bias()
        check_count("logprobs", self.logprobs)
        check_count("prompt_logprobs", self.prompt_logprobs)
        if isinstance(self.structured_output, dict):
            object.__setattr__(self, "structured_output", StructuredOutput(**self.structured_output))
        if self.structured_output is not None and self.min_tokens > 0:
            # A ban on the stop tokens where the grammar allows only those leaves nothing to sample.
            raise ValueError(f"min_tokens={self.min_tokens}: cannot be combined with response_format, "
                             "whose grammar decides where the output ends; use 0")

    def _check_logit_bias(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        object.__setattr__(self, "logit_bias", pairs)
        for token_id, bias in pairs:
            if token_id < 0:
                raise ValueError(f"logit_bias={{{token_id}: {bias}}}: token ids must be >= 0")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias={{{token_id}: {bias}}}: a bias must be in [-100, 100]")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must lie inside the model's vocabulary."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias={{{bad[0]}: ...}}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prompt and generated).
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    # The output text a caller sees so far (while running, less what a stop string may cut).
    output_text: str = ""
    # Decodes the output token by token and finds stop strings; the engine sets it on admission.
    detokenizer: Detokenizer | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0
    # Positions 1.. of the prompt, as they are computed (with params.prompt_logprobs).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One per output token (with params.logprobs).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Not admitted before this request's prompt is in the cache (the first of n choices), so
    # that its pages are computed once and shared through the prefix cache.
    prefill_after: Request | None = None

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without joining the two: a decode step reads
        one token, and joining a 128K-token prompt with its output cost ~0.6 ms a request."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What a request produced so far; ``new_*`` hold the part added by the last step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    # With params.logprobs: one per new token, and one per token so far.
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With params.prompt_logprobs (complete from the first output on): prompt positions 1.. .
    prompt_logprobs: list[TokenLogprobs] | None = None
