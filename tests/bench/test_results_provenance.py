"""Every result names its commit: in its JSON's provenance or in its file name. Older cited files
that name none are listed in benchmarks/results/no-commit.txt, which nothing new may join."""

import json
from pathlib import Path

from spin_cluster.bench.index import rows
from spin_cluster.bench.results import NO_COMMIT_LIST, commit_of, grandfathered, without_commit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_result_names_its_commit_or_is_an_older_listed_one():
    unlisted = sorted(set(without_commit(RESULTS)) - set(grandfathered(RESULTS)))
    assert not unlisted, (f"results that name no commit: {unlisted}; write them with "
                          "spin_cluster.provenance.write_json (or SPIN_COMMIT=<sha>), or put the commit in a log's name")


def test_the_older_list_holds_only_cited_files_that_name_no_commit():
    cited = {r["file"]: r["docs"] for r in rows(ROOT)}
    for rel in grandfathered(RESULTS):
        assert rel in cited, f"{NO_COMMIT_LIST} lists {rel}, which is not under benchmarks/results/"
        assert commit_of(RESULTS / rel) == "none", f"{rel} names its commit: take it off {NO_COMMIT_LIST}"
        assert cited[rel], f"{rel} is cited by no doc and names no commit: remove it"


def test_the_commit_comes_from_the_provenance_else_the_name(tmp_path):
    def result(name: str, body: object = None) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(body) if body is not None else "log")
        return path

    assert commit_of(result("2026-12-07-h200-x.json", {"provenance": {"commit": "fe0d499"}})) == "fe0d499"
    assert commit_of(result("2026-12-07-h200-y-2f88ca8.json", {"provenance": {"commit": "unknown"}})) == "2f88ca8"
    assert commit_of(result("2026-12-05-h200-profile-128k-a376eae.log")) == "a376eae"
    assert commit_of(result("2026-12-05-h200-profile-128k-batch1-9dbc025-run.log")) == "9dbc025"
    # Dates, sizes and words are not commits: a part needs 7+ hex digits with a letter and a digit.
    for name in ("2026-12-04-h200-sweep-0.155-dense.md", "2026-12-04-h200-cap64f-run.log",
                 "2026-12-02-h200-1234567-run.log", "2026-12-02-h200-deadbeef.log", "2026-12-02-cpu-2f88ca8x.log"):
        assert commit_of(result(name)) == "none", name


def test_a_new_result_without_a_commit_is_caught(tmp_path):
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "2026-12-08-h200-new.json").write_text(json.dumps({"provenance": {"commit": "unknown"}}))
    (tmp_path / "e2e" / "2026-12-08-h200-new-fe0d499.log").write_text("log")
    (tmp_path / NO_COMMIT_LIST).write_text("# older files\ne2e/2026-11-29-h200-old.log\n")
    assert without_commit(tmp_path) == ["e2e/2026-12-08-h200-new.json"]
    assert grandfathered(tmp_path) == ["e2e/2026-11-29-h200-old.log"]
