"""Each sparse algorithm's own options (``sparse.options``), typed and chosen by the
algorithm's name, so that a config is checked when it is read (before Ray starts, before any
algorithm module is imported) and ``docs/config.md`` lists every option.

The YAML keeps its shape (``sparse: {algorithm: quest, options: {summary: moments}}``); the
name selects the model here, the way a pydantic discriminated union selects by a tag, with the
tag beside the options rather than inside them. Checks that need the model's shape (a layer
index, a block that divides the page) stay in the algorithm's constructor. An algorithm that
is not listed (one a test or a user registers) declares its own model as ``options_model``,
checked once its class is imported. ``spin_cluster.config.parse_options`` reads these models
and those of the prefill algorithms (``sparse.prefill.options``) alike; top_p, resident_margin
and per_head_budgets, options of every algorithm that scores pages, are read by the system's
Select and budget, not by the algorithm.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

IndexDtype = Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]


class AlgorithmOptions(BaseModel):
    """Options every algorithm takes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index_dtype: IndexDtype | None = Field(None, description=(
        "Select's index (the page summaries it reads each step): float32, bfloat16, float16, or "
        "float8_e4m3fn where the algorithm's kernels take it (labels); null: float32."))


def budget_rows(rows: Any, cast: type) -> Any:
    """Per-head budgets ([L][Hkv], any sequences) as a tuple of tuples of ``cast`` (hashable,
    as a frozen config's fields are); what is not [L][Hkv] numbers is left to the field's type
    check, which says so."""
    try:
        return tuple(tuple(cast(b) for b in row) for row in rows)
    except (TypeError, ValueError):
        return rows


def check_budget_rows(rows: tuple[tuple[float, ...], ...] | None, name: str) -> None:
    if rows is not None and any(b < 0 for row in rows for b in row):
        raise ValueError(f"{name} must be >= 0")


class ScoredOptions(AlgorithmOptions):
    """Options every algorithm that scores pages takes: the rule of Select's middle pages."""

    top_p: float | None = Field(None, gt=0, le=1, description=(
        "Online top-p Select in (0, 1]: per step each head takes the fewest top pages whose "
        "estimated attention mass reaches top_p, the heads of a layer sharing the pages their "
        "budgets add up to (so the buffer reserves that layer total per head). null: top-k."))
    # Near-ties at the budget's edge then stop trading places every step (each trade is a PCIe miss).
    resident_margin: float = Field(0.0, ge=0, description=(
        "Select's hysteresis on the offloaded cache, in nats of estimated attention logit, >= 0: "
        "a page already in the head's GPU buffer share scores as if its logit were this much "
        "higher, so a page outside must beat it by a factor e^margin in estimated attention "
        "weight to take its place. 0: off."))
    # S-HPLB's budgets (spin_cluster.hplb): only an algorithm that scores pages has middle pages to budget.
    per_head_budgets: tuple[tuple[int, ...], ...] | None = Field(None, description=(
        "Per-(layer, KV head) budgets of middle tokens, [L][Hkv] (layers x KV heads), each >= 0; "
        "they replace sparse.budget head by head (under top_p a layer's heads share their sum). "
        "null: sparse.budget for every head."))

    @field_validator("per_head_budgets", mode="before")
    @classmethod
    def _rows(cls, rows: Any) -> Any:
        return budget_rows(rows, int)  # decode budgets are whole tokens

    @model_validator(mode="after")
    def _budgets_not_negative(self) -> ScoredOptions:
        check_budget_rows(self.per_head_budgets, "sparse.options.per_head_budgets")
        return self


# Options that the system reads (``SparseConfig.top_p``, ``.resident_margin``,
# ``.per_head_budgets``: Select's rule and hysteresis, the budget), never the algorithm's
# constructor: the cache builder leaves them out of its keywords.
SELECT_OPTIONS = frozenset(ScoredOptions.model_fields) - frozenset(AlgorithmOptions.model_fields)


class QuestOptions(ScoredOptions):
    """`quest`: a min/max box (or mean and spread) of each page's keys, a page's score the
    best dot product its box allows."""

    score_block_tokens: int = Field(0, ge=0, description=(
        "Bounds per block of this many of a page's tokens, dividing the page size; a page scores "
        "its best block. 0: one box a page."))
    coarse_pages: int = Field(0, ge=0, description=(
        "Two-level Select: groups of this many pages scored first, the best groups' pages then "
        "ranked; 0: off."))
    coarse_factor: int = Field(4, ge=1, description="Two-level Select: candidate pages per budgeted page, >= 1.")
    coarse_split: StrictBool = Field(True, description=(
        "Two-level Select: each scoring stage over many programs a row, in two launches."))
    summary: Literal["bounds", "moments"] = Field("bounds", description=(
        '"bounds": each page\'s min/max per key channel (Quest); "moments": its mean and standard '
        "deviation per channel (arXiv 2605.27740), the box mean -+ moments_z x std."))
    moments_z: float = Field(1.0, ge=0, description="summary moments: the box's half-width in standard deviations, >= 0.")


class LabelsOptions(ScoredOptions):
    """`labels`: each key's r heaviest channels (by ``||W_q[d]|| x ||W_k[d]||``) kept as a label."""

    channels: float = Field(0, ge=0, description=(
        "Channels a label keeps: a count (>= 1), a share of the head dimension (< 1), or 0 for "
        "a quarter of it."))


class LabelsQuestOptions(LabelsOptions):
    """`labels+quest`: the union of both Selects' pages, or one of them on chosen layers."""

    quest_layers: list[int] | str = Field((), description=(
        'Model layers ranked by Quest alone (a list or "5,11"); the others by the union.'))
    labels_layers: list[int] | str = Field((), description=(
        'Model layers ranked by labels alone (a list or "5,17").'))


class ShadowKVOptions(ScoredOptions):
    """`shadowkv`: per-page key means and the outlier tokens kept whole."""

    outlier_fraction: float | None = Field(None, ge=0, le=1, description=(
        "Share of a page's tokens kept as outliers, in [0, 1]; null: the algorithm's default."))


class RetroInferOptions(ScoredOptions):
    """`retroinfer`: k-means centroids of each segment's keys."""

    segment_pages: int | None = Field(None, ge=0, description="Pages a segment clusters together; 0 or null: the default.")
    num_clusters: int | None = Field(None, ge=0, le=63, description="Centroids per segment, 1..63; 0 or null: the default.")
    kmeans_iters: int | None = Field(None, ge=0, description="k-means iterations; null: the default.")


class SeerOptions(ScoredOptions):
    """`seer`: a trained gate scores the pages."""

    gate_path: str | None = Field(None, description=(
        "The trained gate's file (`spin-cluster profile train-gate`); null: the SPIN_SEER_GATE "
        "environment variable."))


class SparqOptions(ScoredOptions):
    """`sparq` (a study tool): each key scored on the query's r largest channels."""

    channels: int = Field(0, ge=0, description="Channels scored; 0: a quarter of the head dimension.")
    fixed_channels: StrictBool = Field(False, description="The weight-ranked channels of labels in place of the query's.")


# The built-in algorithms, one row each: the module whose import registers the name
# (``spin_cluster.sparse.get_algorithm`` imports it when the name is first asked for) and its
# options. One table, so that a name cannot be listed with a module and without options, or
# under a name its class does not answer to. It sits beside the config (spin_cluster.config
# reads the options), not in spin_cluster.sparse, whose import brings torch; the modules are
# named, not imported. tests/sparse/test_algorithm_options.py holds each model to its class's
# constructor.
BUILTIN: dict[str, tuple[str, type[AlgorithmOptions]]] = {
    "dense": ("spin_cluster.sparse.dense", AlgorithmOptions),
    "streaming": ("spin_cluster.sparse.streaming", AlgorithmOptions),
    "quest": ("spin_cluster.sparse.quest", QuestOptions),
    "shadowkv": ("spin_cluster.sparse.shadowkv", ShadowKVOptions),
    "retroinfer": ("spin_cluster.sparse.retroinfer", RetroInferOptions),
    "seer": ("spin_cluster.sparse.seer", SeerOptions),
    "labels": ("spin_cluster.sparse.labels", LabelsOptions),
    "labels+quest": ("spin_cluster.sparse.either", LabelsQuestOptions),
    # Study tools: an index as large as the K cache, for the accuracy studies (spin-cluster eval).
    "oracle": ("spin_cluster.profiling.oracle", ScoredOptions),
    "sparq": ("spin_cluster.profiling.sparq", SparqOptions),
}
OPTIONS: dict[str, type[AlgorithmOptions]] = {name: options for name, (_, options) in BUILTIN.items()}

