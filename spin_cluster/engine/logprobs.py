"""Log-probabilities a request asked for: of each sampled token, and of its prompt's tokens.

The values are the model's own distribution, ``log_softmax`` of the raw logits, taken before
any sampling processor (logit_bias, min_tokens' bans, a grammar's mask, temperature, top-k,
top-p) changes them: vLLM's default (``logprobs_mode="raw_logprobs"``). One batched pass
serves every row of a step that asked, on whatever device the logits are:

    logits [N, V] ──rows that asked──▶ log_softmax [M, V] ──topk(max k), gather(token)──▶ .tolist() once
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's and OpenAI's bound on top_logprobs.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the ``k`` most likely tokens
    with theirs (most likely first; the token itself may be among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_count(name: str, value: int | None) -> None:
    """A logprobs count must be None or in [0, MAX_LOGPROBS]; ValueError naming the field."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name}={value}: must be in [0, {MAX_LOGPROBS}]")


def raw_logprobs(logits: torch.Tensor, counts: list[int | None]) -> tuple[list[int], torch.Tensor | None]:
    """logits [N, V] -> (the rows whose count is not None, their log_softmax [M, V] float32);
    a copy, so that the sampler may change ``logits`` in place afterwards."""
    rows = [i for i, k in enumerate(counts) if k is not None]
    if not rows:
        return rows, None
    picked = logits if len(rows) == len(counts) else logits[torch.tensor(rows, device=logits.device)]
    return rows, torch.log_softmax(picked.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], counts: list[int]) -> list[TokenLogprobs]:
    """logprobs [M, V], token_ids [M] (the token at each row's position), counts [M] ->
    each row's ``TokenLogprobs`` with its ``counts[i]`` most likely tokens."""
    if not token_ids:
        return []
    k = max(counts)
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [M]
    top_values, top_ids = [[]] * len(token_ids), [[]] * len(token_ids)
    if k:
        top = logprobs.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()  # [M, k] each
    return [TokenLogprobs(t, lp, tuple(zip(top_ids[i][:c], top_values[i][:c])))
            for i, (t, lp, c) in enumerate(zip(token_ids, chosen, counts))]
