"""What a file under benchmarks/results/ says of itself: its provenance and the commit it names.

A result names its commit in its JSON's ``provenance`` (``spin_cluster.provenance.write_json``
writes it) or, for a log, a report or a plot, in its file name (``...-profile-128k-a376eae.log``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# A commit in a file name: a part between hyphens (or before the extension) of 7 to 40 hex
# digits with a letter and a digit, so that a date's or a size's digits never pass for one.
_NAME_COMMIT = re.compile(r"(?<=-)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)([0-9a-f]{7,40})(?=[-.])")
# Files beside the results that are not results: this index, the headline rows, the list of
# older files that name no commit.
NO_COMMIT_LIST = "no-commit.txt"
NOT_RESULTS = frozenset({"README.md", "headline.yaml", NO_COMMIT_LIST})


def result_files(results: Path) -> list[str]:
    """Every result under ``results``, as a path relative to it, sorted."""
    return sorted(str(p.relative_to(results)) for p in results.rglob("*")
                  if p.is_file() and str(p.relative_to(results)) not in NOT_RESULTS)


def commit_of(path: Path) -> str:
    """The commit a result names: its JSON's provenance, else its file name; "none" if neither."""
    commit = provenance_of(path).get("commit")
    if commit and commit not in ("none", "unknown"):
        return commit
    named = _NAME_COMMIT.findall(path.name)
    return named[-1] if named else "none"


def provenance_of(path: Path) -> dict:
    """A JSON result's ``provenance`` object; {} for any other file or a JSON without one."""
    if path.suffix != ".json":
        return {}
    try:
        body = json.loads(path.read_text())
    except ValueError:
        return {}
    prov = body.get("provenance") if isinstance(body, dict) else None
    return prov if isinstance(prov, dict) else {}


def without_commit(results: Path) -> list[str]:
    """The result files (relative to ``results``) that name no commit."""
    return [rel for rel in result_files(results) if commit_of(results / rel) == "none"]


def grandfathered(results: Path) -> list[str]:
    """The older files in ``no-commit.txt`` that may name no commit; a new result must name one."""
    path = results / NO_COMMIT_LIST
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
