"""Turn the last-position logits of each request into its next token.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p, and
draw with the request's own generator when it has a seed, so that a seeded request gives the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from spin_cluster.engine.request import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._engine_gen = torch.Generator(device="cpu").manual_seed(seed)
        self._request_gens: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_gens.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """logits: [B, V] float32 -> B token ids. ``logits`` is changed in place (logit_bias)."""
        add_logit_bias(logits, params)
        greedy_ids = logits.argmax(dim=-1).tolist()
        out = list(greedy_ids)
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.greedy:
                out[i] = self._sample_row(logits[i], rid, p)
        return out

    def _sample_row(self, row: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        probs = filtered_probs(row.float().cpu(), p)
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, p)))

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._engine_gen
        gen = self._request_gens.get(request_id)
        if gen is None:
            gen = self._request_gens[request_id] = torch.Generator(device="cpu").manual_seed(p.seed)
        return gen


def add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """logits: [B, V]; every row's logit_bias added by one scatter-add for the whole batch."""
    rows, token_ids, biases = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            rows.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p."""
    logits = row / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token if the mass before it is under top_p: the top token always survives.
        keep_sorted = (sorted_probs.cumsum(0) - sorted_probs) < p.top_p
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum()
    return probs
