"""Where a Select loses the needle: per layer and KV head, the needle page's rank and the
attention mass each Select keeps, against the oracle.

One dense forward of a passkey prompt with its answer appended (teacher forcing) captures,
per layer, every key and the queries of the answer steps: the last prompt position (it
writes the key's first token) and each answer token but the last. At each of those steps
and for each (layer, KV head), every Select under study indexes the keys written so far
and scores the pages for the step's query, as the engine does (``SpinAttention``)::

    page:   sink | middle: the top ``budget`` pages by the Select's score | local (tail last)
    needle pages: the pages holding a token of the pass key's digits (each occurrence)

    needle_mass   the dense softmax mass on the needle pages, mean over the G query heads
    rank          the best (0-based) rank of a needle page among the middle pages under a
                  score; "edge" when a needle page is a sink or local page (always kept)
    recall        the dense softmax mass on every kept token (sink, selected, local), mean
                  over the G query heads: what the Select recovers of attention

The oracle scores a page by its true mass (``profiling.oracle``). A head that copies the key
(``needle_mass`` at or above ``--needle-heads``) needs a needle page among its top
``budget`` ranks; the report counts, per Select, the copying heads whose needle page it
keeps, and lists the heads where it misses, with the page's rank under it and under the
oracle.

    python -m spin_cluster.profiling.diagnose --length 2048 --seed 0 --budget 0.0625 \\
        --select quest --select labels --select quest:score_block_tokens=1
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from spin_cluster.config import SparseConfig, parse_config
from spin_cluster.provenance import write_json
from spin_cluster.sparse import SelectPlan, get_algorithm, select_pages
from spin_cluster.sparse.budget import PageBudget

EDGE = -1  # rank of a needle page that is a sink or local page: always kept


@dataclass(frozen=True)
class Capture:
    """One teacher-forced forward: q [L, n, H, D] of the n answer steps, k [L, T, Hkv, D]."""

    q: torch.Tensor
    k: torch.Tensor
    step_positions: tuple[int, ...]  # the position of each answer step's query
    predicted_ok: tuple[bool, ...]  # dense argmax at each step == the answer's next token


@dataclass(frozen=True)
class SelectSpec:
    """A Select under study: an algorithm and its ``sparse.options``; ``label`` names it."""

    algorithm: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()) if k != "model_path")
        return f"{self.algorithm}:{opts}" if opts else self.algorithm

    @classmethod
    def parse(cls, text: str) -> SelectSpec:
        """'quest' or 'quest:score_block_tokens=1,index_dtype=bfloat16'."""
        name, _, rest = text.partition(":")
        options = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"--select {text!r}: options are KEY=VALUE, comma-separated")
            options[key] = _literal(value)
        get_algorithm(name)  # unknown names: the registry's ValueError
        return cls(name, options)


@dataclass(frozen=True)
class HeadRow:
    step: int
    layer: int
    kv_head: int
    needle_mass: float
    oracle_rank: int
    rank: dict[str, int]  # Select label -> rank of the best needle page (EDGE: a sink/local page)
    recall: dict[str, float]  # Select label -> dense mass on its kept tokens


@dataclass(frozen=True)
class Diagnosis:
    length: int
    seed: int
    answer: str
    needle_pages: tuple[int, ...]
    num_pages: int
    budget_pages: int
    predicted_ok: tuple[bool, ...]
    rows: list[HeadRow]

    def copying(self, threshold: float) -> list[HeadRow]:
        return [r for r in self.rows if r.needle_mass >= threshold]

    def summary(self, threshold: float) -> dict[str, dict[str, float]]:
        """Per Select: share of copying (step, layer, head) triples whose needle page it keeps,
        mean needle rank there, and mean recall over every triple."""
        heads = self.copying(threshold)
        out = {}
        for label in self.rows[0].rank if self.rows else ():
            kept = [r.rank[label] < self.budget_pages for r in heads]
            out[label] = {
                "copying_heads": len(heads),
                "needle_kept": sum(kept) / max(1, len(kept)),
                "recall": sum(r.recall[label] for r in self.rows) / len(self.rows),
                "recall_copying": sum(r.recall[label] for r in heads) / max(1, len(heads)),
            }
        return out


class _AnswerCapture:
    """LayerAttention for one whole sequence: causal SDPA, and each layer's keys and the
    queries at ``positions``."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]; window: a sliding-window layer's span
        self.q[layer_id] = q[self.positions].float()
        self.k[layer_id] = k.float()
        mask = None
        if window is not None:  # causal and at most window - 1 tokens back (Gemma 3's local layers)
            t = torch.arange(q.shape[0], device=q.device)
            back = t[:, None] - t[None, :]
            mask = (back >= 0) & (back < window)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)


@torch.inference_mode()
def capture(model: torch.nn.Module, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> Capture:
    """Teacher-forced dense forward of prompt + answer; the answer steps are the positions
    whose next token is an answer token."""
    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt_ids) + list(answer_ids), dtype=torch.long, device=device)  # [T]
    steps = torch.arange(len(prompt_ids) - 1, len(ids) - 1, device=device)  # [n]
    backend = _AnswerCapture(steps)
    hidden = model(ids, torch.arange(len(ids), device=device), backend)  # [T, E]
    predicted = model.compute_logits(hidden[steps]).argmax(-1)  # [n]
    ok = tuple(bool(x) for x in (predicted == ids[steps + 1]).tolist())
    L = len(backend.q)
    return Capture(torch.stack([backend.q[i] for i in range(L)]), torch.stack([backend.k[i] for i in range(L)]),
                   tuple(steps.tolist()), ok)


def needle_token_positions(tokenizer, prompt_ids: Sequence[int], needle: str) -> list[int]:
    """Positions of the prompt tokens that spell any occurrence of ``needle``."""
    ids = list(prompt_ids)
    pieces = [tokenizer.decode([i]) for i in ids]
    text, starts = "", []
    for piece in pieces:
        starts.append(len(text))
        text += piece
    ends = starts[1:] + [len(text)]
    out: set[int] = set()
    at = text.find(needle)
    while at >= 0:
        out.update(i for i, (s, e) in enumerate(zip(starts, ends)) if s < at + len(needle) and e > at)
        at = text.find(needle, at + 1)
    if not out:
        raise ValueError(f"needle {needle!r} is not in the prompt")
    return sorted(out)


def _make(spec: SelectSpec, *, num_layers, num_kv_heads, head_dim, page_size, num_pages, device, model_path):
    cls = get_algorithm(spec.algorithm)
    options = dict(spec.options)
    if "model_path" in inspect.signature(cls.__init__).parameters and model_path:
        options.setdefault("model_path", model_path)
    return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
               max_seqs=1, max_pages_per_seq=num_pages, device=device, **options)


def diagnose(cap: Capture, specs: Sequence[SelectSpec], needle_positions: Sequence[int], sparse: SparseConfig,
             page_size: int, *, model_path: str | None = None, length: int = 0, seed: int = 0,
             answer: str = "") -> Diagnosis:
    L, T, Hkv, D = cap.k.shape
    H = cap.q.shape[2]
    G, S = H // Hkv, page_size
    device = cap.k.device
    total_pages = -(-T // S)
    needle = sorted({p // S for p in needle_positions})
    page_budget = PageBudget(sparse, S, Hkv)
    rows_out: list[HeadRow] = []
    budget_pages = 0
    for step, pos in enumerate(cap.step_positions):
        n = pos + 1  # tokens in context at this step
        P = -(-n // S)
        budget_pages = page_budget.budget_pages(n)
        plan = SelectPlan(
            num_pages=torch.tensor([P], device=device),
            tail_len=torch.tensor([(n - 1) % S + 1], dtype=torch.int32, device=device),
            sink_pages=page_budget.sink_pages, local_pages=page_budget.local_pages,
            budget_pages=torch.full((1, Hkv), budget_pages, dtype=torch.long, device=device),
            max_pages=P, max_budget=budget_pages,
        )
        page = torch.arange(P, device=device)
        is_mid = (page >= plan.sink_pages) & (page < P - plan.local_pages)  # [P]
        algos = [_make(s, num_layers=L, num_kv_heads=Hkv, head_dim=D, page_size=S, num_pages=total_pages,
                       device=device, model_path=model_path) for s in specs]
        row = torch.zeros(1, dtype=torch.long, device=device)
        token_page = torch.arange(n, device=device) // S  # [n]
        for layer in range(L):
            k = cap.k[layer, :n]  # [n, Hkv, D]
            q = cap.q[layer, step]  # [H, D]
            logits = torch.einsum("hd,thd->ht", q, k.repeat_interleave(G, dim=1)) * D**-0.5  # [H, n]
            probs = logits.softmax(-1).view(Hkv, G, n).mean(1)  # [Hkv, n] mean over each KV head's G
            mass = torch.zeros(Hkv, P, device=device).index_add_(1, token_page, probs)  # [Hkv, P]
            needle_mass = mass[:, needle].sum(-1)  # [Hkv]
            ranks, recalls = {}, {}
            oracle_rank = _needle_rank(mass, is_mid, needle)
            for spec, algo in zip(specs, algos):
                algo.on_append(layer, row.expand(n), torch.arange(n, device=device), k)
                scores = algo.score(layer, q[None], row, P)  # [1, Hkv, P]
                # The algorithm's own Select where it has one (Quest's two-level Select keeps
                # pages of its best groups only); else the top-k of its scores.
                picked = algo.select_top(layer, q[None], row, plan, None, 0.0)
                want, _ = picked if picked is not None else select_pages(scores, False, plan, Hkv)  # [1, Hkv, K]
                kept = torch.zeros(Hkv, P + 1, dtype=torch.bool, device=device)
                kept.scatter_(1, torch.where(want[0] >= 0, want[0], P), True)
                recalls[spec.label] = (mass * kept[:, :P]).sum(-1)  # [Hkv]
                ranks[spec.label] = _needle_rank(scores[0].float(), is_mid, needle)
            for h in range(Hkv):
                rows_out.append(HeadRow(step, layer, h, needle_mass[h].item(), oracle_rank[h],
                                        {lab: r[h] for lab, r in ranks.items()},
                                        {lab: r[h].item() for lab, r in recalls.items()}))
    return Diagnosis(length, seed, answer, tuple(needle), total_pages, budget_pages, cap.predicted_ok, rows_out)


def _needle_rank(scores: torch.Tensor, is_mid: torch.Tensor, needle: Sequence[int]) -> list[int]:
    """[Hkv] best rank of a needle page among the middle pages by ``scores`` [Hkv, P] (ties
    count against the needle), EDGE when a needle page is a sink or local page."""
    P = scores.shape[-1]
    pages = [p for p in needle if p < P]
    if any(not is_mid[p] for p in pages):
        return [EDGE] * scores.shape[0]
    mid = torch.where(is_mid, scores, float("-inf"))  # [Hkv, P]
    best = mid[:, pages].amax(-1, keepdim=True)  # [Hkv, 1]
    return (mid >= best).sum(-1).sub(1).tolist()


# ---- report -----------------------------------------------------------------------------------


def report(diag: Diagnosis, threshold: float, max_rows: int = 40) -> str:
    lines = [
        f"needle {diag.answer} at {diag.length} tokens (seed {diag.seed}): needle pages {list(diag.needle_pages)} "
        f"of {diag.num_pages}; middle budget {diag.budget_pages} pages per KV head",
        "dense (teacher-forced) predicts each answer token: "
        + " ".join("ok" if ok else "MISS" for ok in diag.predicted_ok),
        "",
        f"copying heads: (step, layer, KV head) with needle mass >= {threshold}",
        "",
        "| Select | copying heads | needle page kept | recall, copying heads | recall, all heads |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, s in diag.summary(threshold).items():
        lines.append(f"| {label} | {s['copying_heads']} | {100 * s['needle_kept']:.0f}% | "
                     f"{s['recall_copying']:.3f} | {s['recall']:.3f} |")
    heads = diag.copying(threshold)
    labels = list(heads[0].rank) if heads else []
    missed = [r for r in heads if any(r.rank[lab] >= diag.budget_pages for lab in labels)]
    missed.sort(key=lambda r: -r.needle_mass)
    if missed:
        lines += ["", f"copying heads where a Select misses the needle (rank >= {diag.budget_pages}; "
                      f"rank -1: a sink/local page), most needle mass first:", "",
                  "| step | layer | KV head | needle mass | oracle rank | " + " | ".join(labels) + " |",
                  "|---:|---:|---:|---:|---:|" + "---:|" * len(labels)]
        for r in missed[:max_rows]:
            lines.append(f"| {r.step} | {r.layer} | {r.kv_head} | {r.needle_mass:.2f} | {r.oracle_rank} | "
                         + " | ".join(str(r.rank[lab]) for lab in labels) + " |")
        if len(missed) > max_rows:
            lines.append(f"({len(missed) - max_rows} more)")
    layers = sorted({r.layer for r in heads})
    if heads:
        lines += ["", "needle kept per layer (copying heads kept / copying heads), per Select:", ""]
        lines.append("| layer | " + " | ".join(labels) + " |")
        lines.append("|---:|" + "---:|" * len(labels))
        for layer in layers:
            rs = [r for r in heads if r.layer == layer]
            lines.append(f"| {layer} | " + " | ".join(
                f"{sum(r.rank[lab] < diag.budget_pages for r in rs)}/{len(rs)}" for lab in labels) + " |")
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------------


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spin-cluster diagnose", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the prepared default model)")
    p.add_argument("--task", default="passkey", help="a one-answer task of profiling.ruler (default passkey)")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--select", action="append", default=None,
                   help="ALGORITHM[:KEY=VALUE,...], repeatable (default: quest, labels)")
    p.add_argument("--budget", type=float, default=1 / 16,
                   help="middle tokens per KV head: a fraction (0, 1) of the context or tokens (default 1/16)")
    p.add_argument("--sink-tokens", type=int, default=16)
    p.add_argument("--local-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--needle-heads", type=float, default=0.1,
                   help="needle mass at which a head counts as copying the key (default 0.1)")
    p.add_argument("--max-steps", type=int, default=0, help="answer steps to diagnose (0: all)")
    p.add_argument("--rows", type=int, default=40, help="missed heads listed at most")
    p.add_argument("--json", default=None, help="also write every (step, layer, head) row here, with its provenance")
    return p


def run(args: argparse.Namespace) -> Diagnosis:
    from spin_cluster.model_store import prepare_default_model
    from spin_cluster.models import load_model
    from spin_cluster.profiling import ruler
    from spin_cluster.tokenizer import Tokenizer

    path = args.model or str(prepare_default_model())
    if args.length < 64 or args.page_size < 1:
        raise ValueError("--length must be >= 64 and --page-size >= 1")
    specs = [SelectSpec.parse(s) for s in (args.select or ["quest", "labels"])]
    # No budget floor: the diagnosis ranks pages against the budget itself.
    sparse = parse_config(SparseConfig, {"algorithm": "quest", "budget": args.budget, "budget_floor_tokens": 0,
                                         "sink_tokens": args.sink_tokens, "local_tokens": args.local_tokens}, ("sparse",))
    tok = Tokenizer(path)
    sample = ruler.make_sample(args.task, tok, args.length, args.seed)
    if len(sample.answers) != 1:
        raise ValueError(f"task {args.task!r} has {len(sample.answers)} answers; diagnose needs a one-answer task")
    answer = sample.answers[0]
    answer_ids = ruler.plain_ids(tok, " " + answer)
    if args.max_steps:
        answer_ids = answer_ids[: args.max_steps + 1]
    model = load_model(path, dtype=args.dtype, device="cpu", progress=False).eval()
    cap = capture(model, sample.prompt_ids, answer_ids)
    needle = needle_token_positions(tok, sample.prompt_ids, answer)
    return diagnose(cap, specs, needle, sparse, args.page_size, model_path=path, length=args.length,
                    seed=args.seed, answer=answer)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        diag = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(diag, args.needle_heads, args.rows))
    if args.json:
        write_json(args.json, asdict(diag), indent=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
