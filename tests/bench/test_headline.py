"""The "where things stand" tables: generated from the result files that
benchmarks/results/headline.yaml names, current in the docs and the README, within the docs'
first screen; a stale table or a missing result file fails."""

import json
from pathlib import Path

import pytest
import yaml

from spin_cluster.bench.headline import BEGIN, DOCS, END, README, render_docs

ROOT = Path(__file__).resolve().parents[2]
FIRST_SCREEN_LINES = 40
README_MAX_LINES = 120


def test_the_tables_are_current():
    for path, text in render_docs(ROOT).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run spin-cluster bench index"


@pytest.mark.parametrize("doc", sorted(DOCS.values()))
def test_each_doc_opens_with_its_table(doc):
    lines = (ROOT / doc).read_text().splitlines()[:FIRST_SCREEN_LINES]
    assert BEGIN in lines and END in lines, f"{doc}: the headline table must end within its first {FIRST_SCREEN_LINES} lines"
    rows = lines[lines.index(BEGIN) + 1:lines.index(END)]
    assert rows[0].startswith("| config | model | shape | measure |") and len(rows) > 2


def test_the_readme_is_short_and_its_quick_start_is_two_commands():
    text = (ROOT / README).read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    quick = text.split("## Quick start", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in quick.splitlines()] == [["make", "serve"], ["make", "test"]]


def _tree(tmp_path: Path, value: float) -> Path:
    """A repository with one result, one headline row over it and docs with the markers."""
    results = tmp_path / "benchmarks" / "results"
    (results / "e2e").mkdir(parents=True, exist_ok=True)
    body = {"provenance": {"commit": "0123abcd", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-07T01:00:00+00:00"},
            "spin": {"tok_s": value, "buffer_hits_total": 3, "buffer_misses_total": 1}, "dense": {"tok_s": 100.0}}
    (results / "e2e" / "2026-12-07-h100-x.json").write_text(json.dumps(body))
    (results / "headline.yaml").write_text(
        "performance:\n"
        "  - {config: spin, model: m, shape: 4 x 128K, measure: tok/s, file: e2e/2026-12-07-h100-x.json,\n"
        "     value: spin/tok_s, base: dense/tok_s, hits: spin, kind: ratio, readme: speed}\n")
    (tmp_path / "docs").mkdir(exist_ok=True)
    for rel in [*DOCS.values(), README]:
        (tmp_path / rel).write_text(f"# Doc\n\n{BEGIN}\n{END}\n\nText.\n")
    return tmp_path


def test_a_row_is_read_from_its_file_and_a_changed_figure_makes_the_table_stale(tmp_path):
    root = _tree(tmp_path, 250.0)
    docs = render_docs(root)
    perf = docs[root / DOCS["performance"]]
    # the GPU by its short name; the buffer's hits from a mode's lookup counters (e2e.py's)
    assert ("| spin | m | 4 x 128K | tok/s | 250.0 (100.0) | **2.50x** | 75% | H100 | 2026-12-07 | `0123abc` "
            "| [2026-12-07-h100-x.json](../benchmarks/results/e2e/2026-12-07-h100-x.json) |") in perf
    assert perf.endswith(f"{END}\n\nText.\n")
    assert "| speed | **2.50x** | m, 4 x 128K | H100, 2026-12-07 | [docs/performance.md](docs/performance.md) |" \
        in docs[root / README]
    for path, text in docs.items():
        path.write_text(text)
    assert render_docs(_tree(tmp_path, 300.0))[root / DOCS["performance"]] != perf


def test_a_missing_result_file_or_field_fails(tmp_path):
    root = _tree(tmp_path, 250.0)
    (root / "benchmarks" / "results" / "e2e" / "2026-12-07-h100-x.json").unlink()
    with pytest.raises(FileNotFoundError, match="2026-12-07-h100-x.json"):
        render_docs(root)
    root = _tree(tmp_path, 250.0)
    yaml_path = root / "benchmarks" / "results" / "headline.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("spin/tok_s", "spin/tok_per_s"))
    with pytest.raises(ValueError, match="no number at 'spin/tok_per_s'"):
        render_docs(root)


def test_a_doc_without_markers_is_an_error(tmp_path):
    root = _tree(tmp_path, 250.0)
    (root / DOCS["accuracy"]).write_text("# Accuracy\n")
    with pytest.raises(ValueError, match="docs/accuracy.md has no headline markers"):
        render_docs(root)


def test_every_cited_result_is_under_results():
    rows = yaml.safe_load((ROOT / "benchmarks" / "results" / "headline.yaml").read_text())
    files = [f for table in rows.values() for row in table for f in (row.get("file"), row.get("base_file")) if f]
    assert files and all((ROOT / "benchmarks" / "results" / f).is_file() for f in files)
