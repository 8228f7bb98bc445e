"""Every relative link in the README and the docs resolves: the file exists and, for a link into
a markdown file with ``#anchor``, the anchor is one of its headings. Paths the prose names in
backticks (``docs/x.md``) exist too."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "helm" / "README.md", ROOT / "benchmarks" / "results" / "README.md",
               *(ROOT / "docs").rglob("*.md")])
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_NAMED_DOC = re.compile(r"`((?:docs|helm|benchmarks)/[\w./-]+\.md)`")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(doc: Path) -> list[str]:
    text = _FENCE.sub("", doc.read_text())
    bad = []
    for target in _LINK.findall(_CODE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target}: no heading with that anchor")
    bad += [f"`{named}`: no such file" for named in _NAMED_DOC.findall(text) if not (ROOT / named).exists()]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## The B section (2026)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](a.md#the-b-section-2026) [gone](b.md) ![img](a.md)\n[bad anchor](a.md#nope)\n"
                   "[web](https://example.com) `[not a link](x.md)`\n```\n[in code](y.md)\n```\n")
    assert broken_links(doc) == ["b.md: no such file", "a.md#nope: no heading with that anchor"]
