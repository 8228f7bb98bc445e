"""The S-HPLB profiler: per-(layer, KV head) attention mass recovered as a function of budget,
measured offline on calibration prompts; the stability of per-head needs across prompt
families; a heatmap of the profile.

For each calibration prompt, one dense forward; at each of the prompt's last ``queries``
positions (decode-like: the end of the question and the answer prefix), per layer::

    exact attention of every query head over the keys up to its position   [Q, H, T]
    -> mass per page (page_size tokens)                                    [Q, H, P]
    -> mean over the G query heads of each KV head (``GQA_REDUCTION``)     [Q, Hkv, P]
    -> sink and local pages always kept; middle pages taken best first      [Q, Hkv, P]
       by the Select the engine serves with (``ProfileConfig.select``: its
       own page scores), or by their true mass (``select=None``, the oracle)
    -> recovered mass at each budget fraction of ``FRACTIONS``             [Q, Hkv, F]

With ``answer_steps`` the task prompts' query positions are their answer steps instead
(teacher-forced: the prompt followed by its answer).

Why the serving Select's ranking: max-min shifting takes pages from the heads whose level is
already high at a few pages and gives them to the worst-served. Under the oracle ranking a
copying head (the needle in one page) is at 0.95 with one page, so it drops to its floor;
but the serving Select's estimate ranks that page lower than the oracle does, and at the
floor it loses the needle. Ranked by the serving Select, the same head's level stays low
until its budget reaches the needle's rank under that Select, and it keeps the pages.

averaged over query positions and prompts, per family of prompts:

    retrieval            RULER needle tasks (niah_*)
    tracing_aggregation  RULER variable tracking and word counting (vt, cwe, fwe)
    prose                real text: consecutive sentences of Python's standard-library
                         docstrings, no question

Calibration seeds start at ``ProfileConfig.seed`` (default 1000) so that the prompts a
profile is made from are not the prompts the accuracy runs score (seeds 0, 1, ...).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from spin_cluster.hplb.profile import FamilyCurves, HeadProfile, model_identity
from spin_cluster.sparse.budget import local_pages, sink_pages

# Middle budget as a fraction of the context: 0, then 1/1024 .. 1 in steps of 2^(1/8)
# (9% apart), fine where budgets are set (1/64 .. 1/4) and short on the flat tail.
FRACTIONS = np.concatenate([[0.0], 2.0 ** (np.arange(-80, 1) / 8)])

FAMILIES: dict[str, tuple[str, ...]] = {
    "retrieval": ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"),
    "tracing_aggregation": ("vt", "cwe", "fwe"),
    "prose": ("prose",),
}


@dataclass(frozen=True)
class ProfileConfig:
    # Model folder; None: the default model (SmolLM2-135M-Instruct).
    model_path: str | None = None
    # Prompt lengths in tokens, each <= the model's context.
    lengths: tuple[int, ...] = (2048,)
    # Prompts per task (and per length); the prose family gets as many as retrieval, >= 1.
    samples: int = 2
    # Decode-like query positions per prompt: its last ones, >= 1.
    queries: int = 16
    # Families of calibration prompts (keys of ``FAMILIES``).
    families: tuple[str, ...] = tuple(FAMILIES)
    # Page size, sink and local tokens as the engine will use them (cache.page_size, sparse.*).
    page_size: int = 16
    sink_tokens: int = 16
    local_tokens: int = 64
    device: str = "auto"
    dtype: str = "auto"
    # First calibration seed; accuracy runs score seeds 0, 1, ... so keep this apart.
    seed: int = 1000
    # The Select whose ranking of the middle pages the levels count (a registered algorithm
    # with scores, e.g. "quest"); None: the oracle (pages by their true mass).
    select: str | None = None
    # Read the task prompts' queries at their answer steps (teacher forcing: the prompt, then
    # its answer), where copying heads look for the needle, instead of the prompt's last
    # ``queries`` positions (the question, where they mostly do not). Prose keeps its last.
    answer_steps: bool = False

    def __post_init__(self) -> None:
        for name in ("lengths", "families"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"families {unknown or '(none)'}: choose from {', '.join(FAMILIES)}")
        if not self.lengths or min(self.lengths) < 2 * self.queries:
            raise ValueError(f"give lengths of at least {2 * self.queries} tokens (twice --queries)")
        if self.samples < 1 or self.queries < 1:
            raise ValueError("samples and queries must be >= 1")
        if self.page_size < 1 or self.sink_tokens < 0 or self.local_tokens < 0:
            raise ValueError("page_size must be >= 1, sink_tokens and local_tokens >= 0")
        if self.select is not None:
            from spin_cluster.sparse import get_algorithm

            cls = get_algorithm(self.select)  # unknown names: the registry's ValueError
            if cls.selects_all or self.select == "streaming":
                raise ValueError(f"select={self.select!r} scores no page; give a Select that ranks pages (e.g. quest)")


class MassRecorder:
    """LayerAttention for one whole prompt in one forward: causal SDPA for the model, and
    per layer the recovered-mass curves [Hkv, F] of the last ``queries`` positions."""

    def __init__(self, queries: int, page_size: int, sink_tokens: int, local_tokens: int,
                 select=None) -> None:
        self.queries = queries
        self.page_size = page_size
        self.sink_pages = sink_pages(sink_tokens, page_size)
        self.local_pages = local_pages(local_tokens, page_size)
        # A SparseAlgorithm instance (one request row, every layer) ranking the middle pages,
        # or None: the oracle.
        self.select = select
        self.curves: dict[int, torch.Tensor] = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]
        if window is not None:
            # A sliding-window layer (Gemma 3) keeps only its window, which no Select thins: its
            # heads keep all their mass at every budget.
            from spin_cluster.dense_attention import sliding_window_attention

            self.curves[layer_id] = torch.ones(k.shape[1], len(FRACTIONS), dtype=torch.float64)
            return sliding_window_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True,
        )  # [1, H, T, D]
        self.curves[layer_id] = self.recovered_mass(q, k, layer_id).mean(0).cpu()  # [Hkv, F]
        return o[0].transpose(0, 1)

    def _select_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, P: int) -> torch.Tensor:
        """[Q, Hkv, P] the Select's page scores for the queries at ``pos``; its index holds the
        whole prompt's keys (a page past a query's context is never a middle page of it)."""
        T = k.shape[0]
        row = torch.zeros(T, dtype=torch.long, device=k.device)
        self.select.on_append(layer, row, torch.arange(T, device=k.device), k)
        return self.select.score(layer, q[pos], row[: len(pos)], P).float()

    def recovered_mass(self, q: torch.Tensor, k: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """[Q, Hkv, F] mass each KV head keeps at each budget fraction, per query position."""
        T, H, D = q.shape
        Hkv, S = k.shape[1], self.page_size
        dev = q.device
        pos = torch.arange(max(0, T - self.queries), T, device=dev)  # [Q]
        logits = torch.einsum("qhd,thd->qht", q[pos].float(), k.float().repeat_interleave(H // Hkv, 1)) * D**-0.5
        causal = torch.arange(T, device=dev)[None, :] <= pos[:, None]  # [Q, T]
        probs = logits.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1)  # [Q, H, T]
        P = -(-T // S)
        page = F.pad(probs, (0, P * S - T)).unflatten(-1, (P, S)).sum(-1)  # [Q, H, P]
        page = page.unflatten(1, (Hkv, H // Hkv)).mean(2)  # [Q, Hkv, P]
        n = pos // S + 1  # [Q] pages in each query's context, its tail last
        p = torch.arange(P, device=dev)
        in_ctx = p < n[:, None]  # [Q, P]
        kept = in_ctx & ((p < self.sink_pages) | (p >= n[:, None] - self.local_pages))
        mid = in_ctx & ~kept
        base = (page * kept[:, None, :]).sum(-1)  # [Q, Hkv]
        middle = page.masked_fill(~mid[:, None, :], 0.0)  # [Q, Hkv, P]
        if self.select is None:  # the oracle: pages by their own mass
            best = middle.sort(-1, descending=True).values.cumsum(-1)  # [Q, Hkv, P]
        else:  # pages in the Select's order, middle pages first
            scores = self._select_scores(layer, q, k, pos, P).masked_fill(~mid[:, None, :], float("-inf"))
            order = scores.sort(dim=-1, descending=True, stable=True).indices
            best = middle.gather(-1, order).cumsum(-1)
        best = F.pad(best, (1, 0))  # best[..., j]: mass of the j best middle pages
        fractions = torch.as_tensor(FRACTIONS, dtype=torch.float64, device=dev)
        tokens = (fractions[None, :] * (pos[:, None] + 1)).floor()  # [Q, F] as the engine rounds
        pages = (tokens / S).ceil().long().clamp(max=mid.sum(-1, keepdim=True))  # [Q, F]
        taken = best.gather(-1, pages[:, None, :].expand(-1, Hkv, -1))  # [Q, Hkv, F]
        return (base[..., None] + taken).clamp(max=1.0)


def calibration_prompts(config: ProfileConfig, tokenizer) -> Iterator[tuple[str, int, list[int], int]]:
    """(family, length, ids, query positions) for every family x task x length x sample: the
    ids end with the query positions a profile reads (its last ``queries`` prompt positions;
    with ``answer_steps``, a task's prompt followed by its answer but the last token, so that
    the last positions are the answer steps)."""
    from spin_cluster.profiling import ruler

    per_task = {name: FAMILIES[name] for name in config.families}
    for family, tasks in per_task.items():
        for n, task in itertools.product(config.lengths, tasks):
            count = config.samples * (len(FAMILIES["retrieval"]) if task == "prose" else 1)
            for i in range(count):
                seed = config.seed + i
                if task == "prose":
                    yield family, n, prose_ids(tokenizer, n, seed), config.queries
                    continue
                sample = ruler.make_sample(task, tokenizer, n, seed)
                if not config.answer_steps:
                    yield family, n, list(sample.prompt_ids), config.queries
                    continue
                answer = ruler.plain_ids(tokenizer, " " + ", ".join(sample.answers))
                yield family, n, list(sample.prompt_ids) + answer[:-1], len(answer)


def prose_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` tokens of consecutive docstring sentences, from a seeded start."""
    import random

    from spin_cluster.profiling import haystack, ruler

    pool = haystack.sentences("docs")
    start = random.Random(f"prose/{num_tokens}/{seed}").randrange(len(pool))
    count = max(1, num_tokens // 4)  # sentences are ~20 tokens: several times enough text
    ids = ruler.plain_ids(tokenizer, " ".join(haystack.run_of_sentences("docs", start, count)))
    if len(ids) < num_tokens:
        raise ValueError(f"the docs corpus gives {len(ids)} tokens, short of --lengths {num_tokens}")
    return ids[:num_tokens]


def profile_model(config: ProfileConfig, *, progress: bool = True) -> HeadProfile:
    """Measure the head profile of ``config.model_path`` (default: the prepared default model)."""
    from tqdm.auto import tqdm

    from spin_cluster.engine.device import resolve_device, resolve_dtype
    from spin_cluster.model_store import prepare_default_model
    from spin_cluster.models import load_model
    from spin_cluster.tokenizer import Tokenizer

    path = config.model_path or str(prepare_default_model())
    device = resolve_device(config.device)
    model = load_model(path, dtype=resolve_dtype(config.dtype, device), device=device, progress=False).eval()
    limit = model.config.max_position_embeddings
    if max(config.lengths) > limit:
        raise ValueError(f"--lengths {max(config.lengths)} exceeds the model's context ({limit} tokens)")
    prompts = list(calibration_prompts(config, Tokenizer(path)))
    sums: dict[str, list] = {}
    for family, _, ids, queries in tqdm(prompts, desc="profile", unit="prompt", disable=not progress):
        recorder = MassRecorder(queries, config.page_size, config.sink_tokens, config.local_tokens,
                                _select(config, model, path, len(ids), device))
        with torch.inference_mode():
            model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), recorder)
        curves = torch.stack([recorder.curves[i] for i in sorted(recorder.curves)]).double().numpy()  # [L, Hkv, F]
        acc = sums.setdefault(family, [0, 0.0])
        acc[0] += 1
        acc[1] = acc[1] + curves
    return HeadProfile(
        model=model_identity(path), page_size=config.page_size, sink_tokens=config.sink_tokens,
        local_tokens=config.local_tokens, queries_per_prompt=config.queries, context_tokens=config.lengths,
        fractions=FRACTIONS.copy(),
        families={name: FamilyCurves(count, total / count) for name, (count, total) in sums.items()},
        select=config.select, answer_steps=config.answer_steps,
    )


def _select(config: ProfileConfig, model, path: str, num_tokens: int, device):
    """The profile's Select for one prompt of ``num_tokens`` (None: the oracle)."""
    if config.select is None:
        return None
    import inspect

    from spin_cluster.sparse import get_algorithm

    cls = get_algorithm(config.select)
    mc = model.config
    options = {"model_path": path} if "model_path" in inspect.signature(cls.__init__).parameters else {}
    return cls(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
               page_size=config.page_size, max_seqs=1, max_pages_per_seq=-(-num_tokens // config.page_size),
               device=device, **options)


# ---- stability --------------------------------------------------------------------------------


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (ties get their average rank); nan if either side is constant."""
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):  # ties share the mean of their ranks
        tie = x == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def stability(profile: HeadProfile, coverage: float = 0.9) -> dict[tuple[str, str], float]:
    """Rank correlation of per-head needs (budget fraction to recover ``coverage``) between
    every pair of families."""
    needs = {name: profile.need_fractions(coverage, name).reshape(-1) for name in profile.families}
    return {(a, b): spearman(needs[a], needs[b]) for a, b in itertools.combinations(needs, 2)}


def summary_markdown(profile: HeadProfile, coverage: float = 0.9, budget: float = 1 / 16) -> str:
    """Needs per family and their rank correlations, as markdown."""
    n = profile.reference_tokens
    lines = [f"Per-head need: middle budget (fraction of the context) to recover {coverage:.0%} of the "
             f"attention mass; mass at a 1/{round(1 / budget)} budget. Over {profile.num_layers} layers x "
             f"{profile.num_kv_heads} KV heads, contexts {', '.join(map(str, profile.context_tokens))}.", "",
             "| family | prompts | need: median | need: max | heads needing 0 | mass at budget: min | mean |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    at = int(np.searchsorted(profile.fractions, budget - 1e-12))
    for name, fam in [*profile.families.items(), ("all", None)]:
        need = profile.need_fractions(coverage, None if fam is None else name)
        mass = profile.curves(None if fam is None else name)[..., at]
        prompts = sum(f.num_prompts for f in profile.families.values()) if fam is None else fam.num_prompts
        lines.append(f"| {name} | {prompts} | {np.median(need):.4f} | {need.max():.3f} | {int((need == 0).sum())} "
                     f"| {mass.min():.3f} | {mass.mean():.3f} |")
    pairs = stability(profile, coverage)
    if pairs:
        lines += ["", f"Spearman rank correlation of per-head needs at {coverage:.0%} between families "
                  f"({n}-token reference):", "", "| family A | family B | Spearman |", "|---|---|---:|"]
        lines += [f"| {a} | {b} | {rho:.3f} |" for (a, b), rho in pairs.items()]
    return "\n".join(lines) + "\n"


# ---- plot -------------------------------------------------------------------------------------


def plot_heatmap(profile: HeadProfile, path: str, coverage: float = 0.9, budget: float = 1 / 16) -> None:
    """Two panels over (KV head, layer): the budget each head needs to recover ``coverage`` of
    its attention mass, and the mass it recovers at ``budget``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    need = profile.need_fractions(coverage)  # [L, Hkv]
    at = int(np.searchsorted(profile.fractions, budget - 1e-12))
    mass = profile.mass[..., at]
    L, Hkv = need.shape
    width = max(6.0, 2 * (1.2 + 0.45 * Hkv))
    fig, axes = plt.subplots(1, 2, figsize=(width, max(4.0, 0.22 * L + 1.5)))
    panels = [(need, f"budget to recover {coverage:.0%}\n(fraction of the context)", "magma_r"),
              (mass, f"attention mass recovered at\na 1/{round(1 / budget)} budget", "viridis")]
    for ax, (data, title, cmap) in zip(axes, panels):
        im = ax.imshow(data, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(Hkv))
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"{profile.model.get('name')}: per-head sparsity "
                 f"({', '.join(map(str, profile.context_tokens))} tokens)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
