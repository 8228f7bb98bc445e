"""A model's per-head sparsity profile: how much attention mass each (layer, KV head) keeps at
each budget, measured offline and stored as versioned JSON tied to the model.

    mass[l, h, j]   attention mass (0..1) that (layer l, KV head h) recovers at a decode step
                    when it attends to the sink and local pages plus its best middle pages
                    worth ``fractions[j]`` of the context, averaged over calibration prompts,
                    query positions and the head's G query heads

Budgets are fractions of the context so that one profile serves every length; ``needs`` turns
them into tokens at a given length. Prompts are grouped in families (e.g. needle tasks, prose)
so that the stability of per-head needs across families can be checked; ``mass`` is the
prompt-weighted mean over all families.

The file names the model it was measured on (shape and a hash of its ``config.json``);
``load_profile(path, model_path)`` refuses a profile of another model.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spin_cluster.models.identity import differing_keys, model_identity as shape_and_hash

FORMAT = "spin-cluster/head-profile"
VERSION = 1
# How a KV head's mass is pooled over its G query heads. The pages chosen for a KV head serve
# all G of them, and the layer's output error adds up over them, so the mean is what a
# shared selection should maximise (max would let one query head speak for the group).
GQA_REDUCTION = "mean"


@dataclass(frozen=True)
class FamilyCurves:
    num_prompts: int
    mass: np.ndarray  # [L, Hkv, F] float64, non-decreasing along F


@dataclass(frozen=True)
class HeadProfile:
    model: dict[str, Any]  # ``model_identity`` plus "name" (the model folder's name)
    page_size: int  # tokens per page the budgets were counted in
    sink_tokens: int  # always-kept first tokens, included in every mass
    local_tokens: int  # always-kept last tokens, included in every mass
    queries_per_prompt: int  # decode-like query positions per prompt (its last ones)
    context_tokens: tuple[int, ...]  # prompt lengths profiled
    fractions: np.ndarray  # [F] middle budget as a fraction of the context, 0 .. 1 ascending
    families: dict[str, FamilyCurves] = field(default_factory=dict)
    # The Select whose ranking of the middle pages the masses count ("quest", ...); None: the
    # oracle (pages by their true mass).
    select: str | None = None
    # True: the task prompts' queries were their answer steps (teacher-forced), not their
    # last ``queries_per_prompt`` positions.
    answer_steps: bool = False

    def __post_init__(self) -> None:
        if not self.families:
            raise ValueError("a head profile needs at least one family of calibration prompts")
        shapes = {f.mass.shape for f in self.families.values()}
        if len(shapes) != 1 or next(iter(shapes))[2] != len(self.fractions):
            raise ValueError(f"family curves disagree in shape ({sorted(shapes)}) or with the {len(self.fractions)} fractions")

    @property
    def num_layers(self) -> int:
        return self.mass.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.mass.shape[1]

    @property
    def reference_tokens(self) -> int:
        """The context ``needs`` counts tokens for unless told otherwise: the longest profiled."""
        return max(self.context_tokens)

    @functools.cached_property
    def mass(self) -> np.ndarray:
        """[L, Hkv, F] the prompt-weighted mean of the families' curves."""
        total = sum(f.num_prompts for f in self.families.values())
        return sum(f.mass * (f.num_prompts / total) for f in self.families.values())

    def curves(self, family: str | None = None) -> np.ndarray:
        """[L, Hkv, F] one family's curves, or the mean over all (None)."""
        if family is None:
            return self.mass
        if family not in self.families:
            raise ValueError(f"no family {family!r} in this profile; it has {', '.join(self.families)}")
        return self.families[family].mass

    def need_fractions(self, coverage: float, family: str | None = None) -> np.ndarray:
        """[L, Hkv] smallest middle budget (fraction of the context, interpolated between grid
        points) at which each head recovers ``coverage`` of its attention mass."""
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage={coverage}: use an attention mass in (0, 1]")
        curves = self.curves(family)
        x = self.fractions
        out = np.empty(curves.shape[:2])
        for idx in np.ndindex(*out.shape):
            y = curves[idx]
            j = int(np.searchsorted(y, coverage - 1e-9))  # first grid point at or above coverage
            if j == 0:
                out[idx] = x[0]
            elif j >= len(x):
                out[idx] = x[-1]
            else:
                out[idx] = x[j - 1] + (x[j] - x[j - 1]) * (coverage - y[j - 1]) / max(y[j] - y[j - 1], 1e-12)
        return out

    def needs(self, coverage: float, context_tokens: int | None = None,
              family: str | None = None) -> tuple[tuple[int, ...], ...]:
        """[L][Hkv] middle tokens (whole pages) each head needs to recover ``coverage`` of its
        attention mass at ``context_tokens`` (default: the longest profiled context)."""
        n = context_tokens or self.reference_tokens
        S = self.page_size
        frac = self.need_fractions(coverage, family)
        return tuple(tuple(int(math.ceil(f * n / S - 1e-9)) * S for f in row) for row in frac)

    def recovered(self, head: tuple[int, int], budget_tokens: int | np.ndarray,
                  context_tokens: int | None = None) -> np.ndarray:
        """Mass (layer, KV head) ``head`` recovers at middle budgets ``budget_tokens`` (linear
        between grid points; the whole context at most)."""
        n = context_tokens or self.reference_tokens
        return np.interp(np.minimum(np.asarray(budget_tokens, dtype=float) / n, 1.0), self.fractions, self.mass[head])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "page_size": self.page_size,
            "sink_tokens": self.sink_tokens, "local_tokens": self.local_tokens,
            "queries_per_prompt": self.queries_per_prompt, "gqa_reduction": GQA_REDUCTION, "select": self.select,
            "answer_steps": self.answer_steps,
            "context_tokens": list(self.context_tokens), "fractions": [round(float(x), 8) for x in self.fractions],
            "families": {
                name: {"num_prompts": f.num_prompts, "mass": np.round(f.mass, 5).tolist()}
                for name, f in self.families.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadProfile:
        return cls(
            model=dict(data["model"]), page_size=int(data["page_size"]), sink_tokens=int(data["sink_tokens"]),
            local_tokens=int(data["local_tokens"]), queries_per_prompt=int(data["queries_per_prompt"]),
            context_tokens=tuple(int(n) for n in data["context_tokens"]),
            fractions=np.asarray(data["fractions"], dtype=float),
            families={
                name: FamilyCurves(int(f["num_prompts"]), np.asarray(f["mass"], dtype=float))
                for name, f in data["families"].items()
            },
            select=data.get("select"),  # profiles written before it was recorded: the oracle
            answer_steps=bool(data.get("answer_steps", False)),
        )


def model_identity(model_path: str | Path) -> dict[str, Any]:
    """What a profile is tied to: the model's shape and a hash of its config.json, plus its
    folder name (shown in messages, not compared: the same model lives in other folders)."""
    return {"name": Path(model_path).resolve().name, **shape_and_hash(model_path)}


def save_profile(profile: HeadProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), separators=(",", ":")) + "\n")


def load_profile(path: str | Path, model_path: str | Path | None = None) -> HeadProfile:
    """Read a profile; with ``model_path``, check it was measured on that model (shape and
    config hash) and raise ValueError naming the command that makes the right one."""
    path = Path(path)
    hint = f"make one with `spin-cluster profile --model {model_path or 'MODEL_FOLDER'} --out {path}`"
    if not path.is_file():
        raise ValueError(f"head profile {str(path)!r} not found; {hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not JSON ({e}); {hint}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a head profile; {hint}")
    if data.get("version") != VERSION:
        raise ValueError(f"head profile {str(path)!r} has format version {data.get('version')}, "
                         f"this code reads version {VERSION}; {hint}")
    profile = HeadProfile.from_dict(data)
    if model_path is not None:
        want = model_identity(model_path)
        wrong = differing_keys(profile.model, {k: v for k, v in want.items() if k != "name"}, model_path)
        if wrong:
            raise ValueError(
                f"head profile {str(path)!r} was measured on {profile.model.get('name')!r}, not on "
                f"{want['name']!r} (differs in {', '.join(wrong)}); {hint}"
            )
    return profile
