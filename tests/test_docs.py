"""The docs and the code say what is and why, and the docs' links lead somewhere.

- No tracker numbers (the word "issue" and a number) in the package, the docs or the
  tests, and no history narrated in the docs and tests ("the old code", "before the
  fix"): a reader of a docstring or a design note should learn what the code does and
  why, not which ticket it came from (history belongs to CHANGELOG.md and git).
- Every relative link in a Markdown file under docs/ (and the READMEs beside the code)
  names a file or folder that exists, so moving a design note cannot strand a link.

Fast: reads text files only.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACKER = re.compile(r"\bissue [0-9]", re.IGNORECASE)
HISTORY = re.compile(r"since issue|\bolder code\b|\bthe old code\b|before the fix|before the [A-Za-z0-9 ]*redesign",
                     re.IGNORECASE)
# [text](target) with a target that is not a URL or a bare anchor; an optional #anchor is cut.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".yml", ".yaml"}


def _grep(top: str, pattern: re.Pattern) -> list[str]:
    """`grep -rn PATTERN TOP` over the text files below TOP (this file aside)."""
    hits = []
    for path in sorted((REPO / top).rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
            continue
        if path.resolve() == Path(__file__).resolve():
            continue  # this file names the pattern it looks for
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    return hits


@pytest.mark.parametrize("top", ["docs", "tests", "tensorstore_ck"])
def test_no_tracker_numbers(top):
    hits = _grep(top, TRACKER)
    assert not hits, f"{len(hits)} line(s) cite a tracker item instead of saying what is and why:\n" + \
        "\n".join(hits[:40])


@pytest.mark.parametrize("top", ["docs", "tests"])
def test_no_history_wording(top):
    """Docs and tests describe the code as it is: "the old code did X" says nothing about
    what this code does (a comparison names the commit it measured against instead)."""
    hits = _grep(top, HISTORY)
    assert not hits, f"{len(hits)} line(s) narrate history:\n" + "\n".join(hits[:40])


def _markdown_files() -> list[Path]:
    files = sorted((REPO / "docs").rglob("*.md"))
    files += [p for p in (REPO / "tests" / "README.md", REPO / "benches" / "README.md", REPO / "README.md")
              if p.exists()]
    return files


def test_there_are_docs_to_check():
    """The link check below must not pass by finding nothing."""
    names = {p.relative_to(REPO).as_posix() for p in _markdown_files()}
    assert {"docs/ARCHITECTURE.md", "docs/FORMAT.md", "docs/design/gc.md"} <= names


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    in_code = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor in this file
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(REPO)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
