"""What the deployments send each other: plain frozen dataclasses, pickled by Ray.

    ingress --GenerateRequest--> EngineServer --Admitted | Failed, then Delta...--> ingress
    EngineServer --EngineReport (every stats_interval_s)--> ClusterPlanner
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    # SamplingParams fields by name; the engine server builds (and validates) them.
    sampling: dict[str, Any]
    # Exactly one of: text, token ids, chat messages (rendered by the model's template).
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    # Function tools the chat template lists for the model (OpenAI's ``tools``), or None.
    tools: tuple[dict[str, Any], ...] | None = None
    # Choices sampled from the prompt, each a request of its own (the later ones take the
    # first one's prompt pages); with a seed, choice i draws from seed + i (as vLLM).
    n: int = 1
    # The prompt's text comes back in ``Admitted`` (completions' ``echo``).
    echo: bool = False


@dataclass(frozen=True)
class Admitted:
    """First item of every accepted stream: the request is in the engine."""

    num_prompt_tokens: int
    # With ``GenerateRequest.echo``: the prompt as text (token-id prompts decoded).
    prompt_text: str | None = None


@dataclass(frozen=True)
class Failed:
    """The request was refused (first item) or failed while running (a later item)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities with the tokens as text (what clients are sent)."""

    token: str
    logprob: float | None  # None: a prompt's first token, which nothing before it scores
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """New output of one engine step for one choice of a request."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    # The choice (0 .. n-1).
    index: int = 0
    # With sampling's logprobs: one per token of ``token_ids``.
    logprobs: tuple[TokenLogprob, ...] = ()
    # With sampling's prompt_logprobs, in the choice's first Delta: prompt positions 1.. .
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class KvUsage:
    """Requests, KV pages and cumulative counters: what one engine reports and what the
    planner sums over engines."""

    num_running: int = 0
    num_waiting: int = 0
    # (tier, state) -> pages; tier "gpu" (the device pool, or the offloaded cache's GPU home
    # pages), "host" (home pages in host memory) or "gpu_buffer" (the offloaded cache's slots).
    kv_pages: dict[tuple[str, str], int] = field(default_factory=dict)
    # (tier, state) -> bytes of those pages (K and V).
    kv_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    # tier -> bytes of page-table metadata.
    metadata_bytes: dict[str, int] = field(default_factory=dict)
    # tier ("gpu", "host") -> bytes allocated for its KV pages, free ones included.
    allocated_bytes: dict[str, int] = field(default_factory=dict)
    # Cumulative: buffer_lookups, buffer_hits, retrieved_bytes, evicted_pages, promoted_pages,
    # spilled_pages, preemptions, prefix_cache_queries, prefix_cache_hits (tokens),
    # attention_bubble_s.
    counters: dict[str, float] = field(default_factory=dict)
    # rank -> cumulative attention seconds of that head-parallel rank.
    attention_rank_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EngineReport(KvUsage):
    """One engine's capacity and cumulative counters (since it started); ``reported_s``
    (time.time()) is when it was sent, its state as of the engine's last step or idle wait."""

    replica_id: str
    reported_s: float
    free_kv_tokens: int = 0
    # Requests this engine has admitted since it started.
    num_requests_total: int = 0


@dataclass(frozen=True)
class EnginePlan:
    """What the planner tells an engine at start: its sparse settings (with an S-HPLB
    profile, per-head budgets) and the heads each of its head-parallel ranks owns."""

    sparse: dict[str, Any]
    # rank (the engine's head-parallel ranks: as many as it has keys) -> the (layer, KV head)
    # pairs it owns; ``HeadPlacement.from_rank_heads`` turns it back into a placement. One
    # rank: the plain engine. None: not planned (one rank).
    head_placement: dict[int, tuple[tuple[int, int], ...]] | None = None
    # max rank load / mean rank load - 1 of the placement; 0 when balanced or not placed.
    imbalance: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ClusterStats(KvUsage):
    """The planner's sum over live engines (counters also keep those of engines gone)."""

    num_engines: int = 0
    head_placement_imbalance: float = 0.0
    # Replica id -> requests it admitted, for every engine that ever reported (gone ones too).
    requests_by_engine: dict[str, int] = field(default_factory=dict)
