"""Turn the last-position logits of each request into its next token.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p, and
draw by inverting their cumulative distribution at a uniform number from the request's own
generator when it has a seed (the engine's otherwise), so that a seeded request gives the
same tokens whatever else shares its batch.

The draw is one ``searchsorted`` over the batch's cumulative sums, not ``torch.multinomial``
per row: on the CPU multinomial took 1.0 ms a row over SmolLM2's 49,152 tokens (its setup
is per call), a sixth of a served 16-row decode step (2-vCPU AVX-512 EPYC, one thread); an
exponential race (``probs / Exp(1)``, vLLM's GPU sampler) draws V random numbers a row, 20
ms for 16 rows there. Both give the same distribution; the inverse needs one number a row.
"""

from __future__ import annotations

import torch

from spin_cluster.engine.request import SamplingParams


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without a host sync: on CUDA through pinned
    memory with a non-blocking copy (a copy from pageable memory waits for the stream, which
    would stall a pipelined decode step's launch behind the step before it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
        """logits: [B, V] float32 -> B token ids. ``logits`` is changed in place (logit_bias, and
        the sampled rows' weights)."""
        return self.sample_tensor(logits, request_ids, params).tolist()

    def sample_tensor(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        """``sample``'s tokens as a [B] int64 tensor on the logits' device, with no host sync:
        a pipelined decode step feeds them to the next step before the host reads them."""
        add_logit_bias(logits, params)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if not drawn:
            return logits.argmax(dim=-1)
        out = at = None
        if len(drawn) < len(params):
            out = logits.argmax(dim=-1)
            at = to_device(drawn, logits.device)
            rows = logits.index_select(0, at)
        else:
            rows = logits  # every row drawn: weighed in place, no copy of [B, V]
        weigh(rows, [params[i] for i in drawn])
        # One uniform number per drawn row, from its own generator (on the CPU, whatever the
        # device: a seed gives the same stream on either).
        u = [float(torch.rand((), generator=self._generator(request_ids[i], params[i]))) for i in drawn]
        tokens = draw(rows, to_device(u, rows.device, torch.float32))
        if out is None:
            return tokens
        return out.index_copy_(0, at, tokens)

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
    index = (to_device(rows, device), to_device(token_ids, device))
    logits.index_put_(index, to_device(biases, device, logits.dtype), accumulate=True)


def weigh(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """[N, V] float32 logits of sampled rows -> in place, each row's weights: probabilities
    times a positive constant of the row (``draw`` needs no more). Rows with top-k or top-p one
    at a time (``filtered_probs``), the others (temperature alone) together. In place because
    a fresh [N, V] buffer is new memory, whose page faults cost as much as the arithmetic on
    the CPU (3 MB a tensor at 16 rows of SmolLM2's vocabulary)."""
    filtered = {i: filtered_probs(logits[i], p) for i, p in enumerate(params)
                if p.top_p < 1.0 or 0 < p.top_k < logits.shape[1]}
    for i, probs in filtered.items():
        logits[i] = probs
    rest = [i for i in range(len(params)) if i not in filtered]
    if not rest:
        return
    # The temperature-only rows: all of them in place (the usual batch), else their own rows.
    at = None if len(rest) == len(params) else to_device(rest, logits.device)
    rows = logits if at is None else logits.index_select(0, at)
    temps = [params[i].temperature for i in rest]
    if any(t != 1.0 for t in temps):
        rows.div_(to_device(temps, logits.device, logits.dtype)[:, None])
    rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()
    if at is not None:
        logits.index_copy_(0, at, rows)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] non-negative weights (each row's sum positive) and [N] uniform numbers in [0, 1)
    -> [N] token ids: the first token whose running sum passes u times the row's sum, so a
    token of weight 0 is never drawn (adding 0 leaves a float sum unchanged). ``weights``
    becomes its running sums."""
    cdf = weights.cumsum_(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


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
