"""The README and docs/ link only to files that exist (result files, docs, code), and every committed result
file is JSON with the layout the benchmarks write (``meta`` + ``rows``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(doc: Path) -> list[str]:
    links = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        links.append(target.split("#", 1)[0])
    return links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    links = _relative_links(doc)
    missing = [t for t in links if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_link_pattern_finds_result_links():
    """The check above sees the result links (a pattern that matched nothing would pass vacuously)."""
    readme = _relative_links(ROOT / "README.md")
    assert sum(t.startswith("benchmarks/results/") and t.endswith(".json") for t in readme) > 20
    perf = _relative_links(ROOT / "docs" / "speculative-performance.md")
    assert sum(t.startswith("../benchmarks/results/") for t in perf) > 20


#: Result files written before their bench took the common row layout (kept as measured, not rewritten).
LEGACY_LAYOUT = {"cli_generate-20261130.json", "bench_argmax-20261202-75dd1f3.json",
                 "bench_multi_turn-20261204-1badffc.json"}


def test_result_files_have_meta_and_rows():
    """Every committed result parses as JSON; a bench_*/profile_* file has the layout of STYLE.md's Benchmarks
    section: meta with the GPU and the commit, rows each with provider, metric and value."""
    bad = []
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert len(files) > 100
    for path in files:
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            bad.append(f"{path.name}: {e}")
            continue
        if path.name in LEGACY_LAYOUT or not path.name.startswith(("bench_", "profile_")):
            continue
        meta, rows = data.get("meta"), data.get("rows")
        if not isinstance(meta, dict) or not {"gpu", "git_sha"} <= meta.keys():
            bad.append(f"{path.name}: meta lacks gpu / git_sha")
        elif not isinstance(rows, list) or not rows:
            bad.append(f"{path.name}: no rows")
        elif any(not {"provider", "metric", "value"} <= row.keys() for row in rows):
            bad.append(f"{path.name}: a row lacks provider / metric / value")
    assert not bad, bad
