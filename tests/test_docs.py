"""The docs point at things that exist: every relative markdown link in README.md and docs/ resolves, and every
result file, image and benchmark script a page names by path is in the repository (a moved or removed file leaves no
dangling reference behind)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# paths named in prose or commands: docs/results/..., docs/img/..., benchmarks/....py (from the repository root)
NAMED = re.compile(r"(?<![\w/.-])((?:docs/(?:results|img|notes)/|benchmarks/)[\w./-]+\.(?:jsonl|json|md|png|py|sh))(?![\w-])")


def _pages():
    return [p for p in PAGES if p.is_file()]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            continue  # a web address or an absolute path on the machine that ran it
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(page):
    text = page.read_text(encoding="utf-8")
    named = {p for p in NAMED.findall(text) if not Path(p).stem.isupper()}  # NAME.py, X.md: placeholders
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)}: names files that are not in the repository {missing}"
